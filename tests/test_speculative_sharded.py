"""DSpark speculative decoding sharded (issue 17): the stages shard like the target's layers (Markov head on the
vocabulary axis), so at worlds 2 and 4 speculation emits the sharded engine's own greedy tokens.

Model and requests as tests/test_speculative.py (the 5-layer cut with the stages, float32, rounding points off);
a file of its own so the two worlds' compiles run beside the single-device speculation tests under
``pytest -n 2 --dist loadfile``.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_speculative import MAX_CONTEXT, _oracle, _same, spec_config, spec_requests, stage_drafts

import sharding
from dsv41_jax import make_tiny
from dsv41_jax.engine import Engine, fixed_segments
from dsv41_jax.model.transformer import ModelOptions
from dsv41_jax.speculative import Speculator


@pytest.mark.devices(2)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=[pytest.mark.devices(4), pytest.mark.slow])])
def test_sharded_greedy_matches_plain_greedy(world):
    """At worlds 2 and 4 speculation (random drafts, then forced accept-all) emits the sharded engine's own
    greedy tokens."""
    cfg = spec_config()
    requests = spec_requests(cfg)[1:]
    weights = make_tiny.random_weights(cfg, 0, dspark=True)
    options = ModelOptions(dtype="float32", quant_rounding=False, dspark=True)
    model, mesh = sharding.prepare(cfg, weights, world, options)
    # The prompts (20 and 9 tokens) in one segment: one prefill program for the speculator instead of two, and
    # the reference prefills row by row through its decode program (15 s a world less compiling). Prompts over
    # several segments (the rings and the cache carried from one segment program to the next) are the
    # single-device tests' (`setup`: 16 + 16 + 5 rows).
    engine = Engine(model, cfg, max_context=MAX_CONTEXT, cache_dtype="float32", eos_ids=(), mesh=mesh,
                    segment_plan=lambda n: fixed_segments(n, 32), short_rows=32)
    reference = engine.generate(requests)
    spec = Speculator(engine)
    # The stages' own drafts through the forced run's round program (one round compile a world, not two).
    _same(spec.generate(requests, 5, oracle=stage_drafts(requests, reference)), reference)
    ref = _oracle(requests, reference)
    out = spec.generate(requests, 5, oracle=(ref, np.ones(ref.shape, bool)))
    _same(out, reference)
    assert out.timings.tokens_per_round > 4.0
