"""DSpark speculative decoding with engram layers (issue 17, `MODEL.md` §B.12): the verify rows are hashed on the
host after the committed history only, so random drafts, forced accept-all, a pattern of rejections of every
length and reject-all all emit the engine's greedy tokens, with device tables and with host tables.

Model as tests/test_speculative.py (the 5-layer cut with the stages, float32, rounding points off) of the engram
config (an engram layer at 1); prompts that repeat n-grams, so the hashed rows matter. A file of its own so its
compiles run beside the plain speculation tests under ``pytest -n 2 --dist loadfile``.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_speculative import MAX_CONTEXT, _forced_accept_all_then_partial, _oracle, _same, spec_config, stage_drafts

from dsv41_jax import make_tiny
from dsv41_jax.engine import Engine, Request, fixed_segments
from dsv41_jax.engram import HostTables
from dsv41_jax.loading import build_model
from dsv41_jax.model.transformer import ModelOptions
from dsv41_jax.param_specs import is_engram_table
from dsv41_jax.speculative import Speculator


@pytest.fixture(scope="module")
def engram_setup():
    """The 5-layer cut with an engram layer (1) and the stages (make_tiny's weights, device tables); two ragged
    prompts that repeat n-grams."""
    cfg = spec_config("tiny_engram")
    assert cfg.engram_layer_ids == (1,)
    weights = make_tiny.random_weights(cfg, 2, dspark=True)
    model = build_model(cfg, ModelOptions(dtype="float32", quant_rounding=False, dspark=True), weights)
    # As tests/test_speculative.py's `setup`: the reference prefills row by row (the hash history advanced a row
    # at a time), the speculator in segments (16 + 15 rows).
    engine = Engine(model, cfg, max_context=MAX_CONTEXT, cache_dtype="float32", eos_ids=(),
                    segment_plan=lambda n: fixed_segments(n, 16), short_rows=16)
    assert engine.hasher is not None
    base = np.random.default_rng(5).integers(3, cfg.image_token_id, 10)
    prompts = [np.concatenate([base, base[2:8], base, base[:5]]), np.concatenate([base[4:], base[:7], base[4:]])]
    requests = [Request(tuple(int(t) for t in p), n) for p, n in zip(prompts, (30, 23))]
    reference = engine.generate(requests)
    return cfg, Speculator(engine), requests, reference, weights


@pytest.mark.slow  # engram with speculation: test_trained_model's DSpark test runs the shipped engram model
def test_engram_greedy_matches_plain_greedy(engram_setup):
    """Random drafts (mostly rejected), forced accept-all, and a pattern of rejections of every length: the
    engram history advances by the committed tokens only, so every path emits the engine's greedy tokens."""
    _, spec, requests, reference, _ = engram_setup
    _same(spec.generate(requests, 5, oracle=stage_drafts(requests, reference)), reference)
    _forced_accept_all_then_partial(spec, requests, reference)


def test_engram_reject_all_matches_plain_greedy(engram_setup):
    """Every proposal wrong: each round commits only its bonus token; the rejected drafts' ids never reach the
    hash history (they would change the next rows' n-grams)."""
    cfg, spec, requests, reference, _ = engram_setup
    ref = (_oracle(requests, reference) + 1) % cfg.image_token_id
    out = spec.generate(requests, 5, oracle=(ref, np.ones(ref.shape, bool)))
    _same(out, reference)
    assert out.timings.tokens_per_round == 1.0


@pytest.mark.slow  # host tables with speculation: a layout beyond the path
def test_engram_host_tables_match_plain_greedy(engram_setup):
    """Host tables (``engram_tables="host"``: each call's rows gathered on the host and sent with it): a round's
    verify rows are gathered like a step's; greedy with a pattern of rejections = the device-table engine's greedy
    (same weights; host tables = device tables for plain greedy: tests/test_engram_sharding.py)."""
    cfg, _, requests, reference, weights = engram_setup
    options = ModelOptions(dtype="float32", quant_rounding=False, dspark=True, engram_tables="host")
    model = build_model(cfg, options, {k: v for k, v in weights.items() if not is_engram_table(k)})
    engine = Engine(model, cfg, max_context=MAX_CONTEXT, cache_dtype="float32", eos_ids=(),
                    segment_plan=lambda n: fixed_segments(n, 16), short_rows=16,
                    host_tables=HostTables.from_weights(weights, cfg))
    ref = _oracle(requests, reference)
    use = np.ones(ref.shape, bool)
    for b in range(len(requests)):
        use[b, (np.arange(ref.shape[1]) % (3 + b)) == b] = False
    out = Speculator(engine).generate(requests, 5, oracle=(ref, use))
    _same(out, reference)
    assert 1.5 < out.timings.tokens_per_round < 5.0
