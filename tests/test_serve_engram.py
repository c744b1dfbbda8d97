"""The slot engine on an engram model (TINY-E, `MODEL.md` §B.12) against `Engine.generate` of each request alone
(the reference: tests/test_engram_engine.py checks it against mlx-vlm).

Engram rows are hashed on the host from each call's ids and each sequence's last three ids, so the slot engine
reads every step's tokens before it dispatches the next and keeps a hash history per slot (copied from a long
prompt's one-row prefill when the request joins). Equal tokens mean every slot's history was right at every step:
4 requests (short prompts fed in the decode steps, long ones prefilled apart with a short tail segment, greedy
and seeded) through 2 slots, so slots are reused. Float32, rounding points off.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsv41_jax import make_tiny
from dsv41_jax.config import load_named
from dsv41_jax.engine import Engine, Request, fixed_segments
from dsv41_jax.loading import build_model
from dsv41_jax.model.transformer import ModelOptions
from dsv41_jax.sampling import SamplingParams
from dsv41_jax.serve.slots import Job, SlotEngine


@pytest.mark.slow  # engram slots: the default server (the shipped model has engram) runs in test_serve_structured
def test_engram_slots_equal_alone():
    cfg = load_named("tiny_engram")
    model = build_model(cfg, ModelOptions(dtype="float32", quant_rounding=False), make_tiny.random_weights(cfg, 0))
    engine = Engine(model, cfg, max_context=64, cache_dtype="float32", eos_ids=(),
                    segment_plan=lambda n: fixed_segments(n, 16), short_rows=8)
    assert engine.hasher is not None
    slots = SlotEngine(engine, 2)
    slots.precompile()
    base = np.random.default_rng(3).integers(3, 500, 8)
    ids = np.concatenate([base, base[:4], base])  # repeated n-grams: the hash rows repeat too
    requests = [Request(tuple(int(t) for t in ids[:n]), m,
                        SamplingParams() if i % 2 == 0 else SamplingParams(temperature=1.0, seed=i))
                for i, (n, m) in enumerate([(6, 7), (20, 5), (3, 8), (18, 4)])]
    got: dict[int, list] = {}
    for i, r in enumerate(requests):
        slots.add(Job(i, r, lambda kind, value, i=i: got.setdefault(i, []).append(value) if kind == "token"
                      else None))
    while slots.busy:
        slots.step()
    assert slots.prefill_calls == 2 + 2  # the 20- and 18-token prompts: a 16-row segment and a short tail
    for i, r in enumerate(requests):
        assert tuple(got[i]) == engine.generate([r]).generations[0].token_ids, i
