"""Chunk invariance of the static-shape caches (`MODEL.md` §D.4) and ragged batches.

The reference for every case is the model's own one-pass run of the whole sequence (an independent code path:
no cache reads at all), and `tests/test_parity_mlx.py` ties that one pass to mlx-lm. A 56-token sequence on
TINY: the window (8) evicts, ratio-2 layers see > index_topk entries, the reindex layer > K_B·B_c entries.

Segments of 16 and 5 rows run through the 17-row program with ``lengths`` (the rest is padding), which is
also what makes the padding rows' "don't touch the cache" rule part of every comparison.

Tolerances (logits O(4)): rounding points off 1e-4 (different GEMM shapes change f32 summation order only;
observed ≤ 6e-6). On: a last-bit difference can cross an fp8/fp4 rounding boundary, one quantum, which moves
later logits by up to ~0.8 (`MODEL.md` §C.4), so only the fraction of positions moved by more than 0.1 (and the
median) is bounded: ``model_helpers.assert_close_with_rounding_flips``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from model_helpers import Runner, _graph, assert_close_with_rounding_flips, model_state, split_sizes

import dsv41_jax.model.indexer as indexer
from dsv41_jax.config import load_named
from dsv41_jax.make_tiny import random_weights
from dsv41_jax.model import ModelOptions

TOTAL, PROMPT, MAX_CONTEXT = 56, 48, 64
OPTIONS = {"off": ModelOptions(dtype="float32", quant_rounding=False),
           "on": ModelOptions(dtype="float32", quant_rounding=True)}


@pytest.fixture(scope="module")
def setup():
    cfg = load_named("tiny")
    flat = random_weights(cfg, 0)
    states = {k: model_state(cfg, o, flat) for k, o in OPTIONS.items()}
    ids = np.random.default_rng(7).integers(3, cfg.vocab_size - 3, TOTAL)
    one_pass = {k: Runner(cfg, OPTIONS[k], states[k], rows=TOTAL, max_context=MAX_CONTEXT).prefill(ids, [TOTAL])
                for k in OPTIONS}
    return cfg, states, ids, one_pass


def _check(got, want, rounding: str):
    err = np.abs(got - want)
    if rounding == "off":
        assert err.max() < 1e-4, err.max()
    else:
        assert_close_with_rounding_flips(got, want)  # MODEL.md §C.4: quantum flips are real, bound their share
    return err.max()


@pytest.mark.parametrize("rounding", ["off", "on"])
@pytest.mark.parametrize("size", [16, 17, 5])
def test_segments_then_decode_match_one_pass(setup, rounding, size):
    cfg, states, ids, one_pass = setup
    runner = Runner(cfg, OPTIONS[rounding], states[rounding], rows=17, max_context=MAX_CONTEXT)
    got = runner.prefill(ids, split_sizes(PROMPT, size) + [1] * (TOTAL - PROMPT))  # then 8 one-row decodes
    print(f"\nsegments of {size}, rounding {rounding}: max|Δ| {_check(got, one_pass[rounding], rounding):.2e}")


@pytest.mark.parametrize("rounding", ["off", "on"])
def test_row_by_row_decode_matches_one_pass(setup, rounding):
    cfg, states, ids, one_pass = setup
    runner = Runner(cfg, OPTIONS[rounding], states[rounding], rows=1, max_context=MAX_CONTEXT)
    got = runner.prefill(ids, [1] * TOTAL)
    print(f"\nrow by row, rounding {rounding}: max|Δ| {_check(got, one_pass[rounding], rounding):.2e}")


def test_ragged_batch_matches_one_by_one(setup):
    """Three sequences in one batch, each fed its own schedule of segment lengths (0 = idle this call), so
    they sit at different offsets and groups open/close at different rows; each must equal its one-pass run."""
    cfg, states, ids, one_pass = setup
    seqs = [ids, np.roll(ids, 11), ids[::-1].copy()]
    # Each sequence's one-pass reference (batch 1, the program of `setup`).
    refs = [one_pass["off"]] + [Runner(cfg, OPTIONS["off"], states["off"], rows=TOTAL,
                                       max_context=MAX_CONTEXT).prefill(s, [TOTAL]) for s in seqs[1:]]
    schedules = [[17, 17, 14] + [1] * 8,
                 [5, 0, 17, 3, 16, 7] + [1] * 8,
                 [0, 9, 1, 17, 17, 4] + [1] * 8]
    runner = Runner(cfg, OPTIONS["off"], states["off"], batch=3, rows=17, max_context=MAX_CONTEXT)
    got = [[] for _ in seqs]
    starts = [0, 0, 0]
    for call in range(max(len(s) for s in schedules)):
        segs = []
        for b, sched in enumerate(schedules):
            n = sched[call] if call < len(sched) else 0
            segs.append(seqs[b][starts[b] : starts[b] + n])
            starts[b] += n
        logits, _ = runner.step(segs)
        for b, rows in enumerate(logits):
            got[b].append(rows)
    assert starts == [TOTAL] * 3
    for b in range(3):
        err = np.abs(np.concatenate(got[b]) - refs[b]).max()
        print(f"\nsequence {b}: max|Δ| {err:.2e}")
        assert err < 1e-4
    np.testing.assert_array_equal(np.asarray(runner.cache.offset), [TOTAL] * 3)


def test_padding_rows_with_a_zero_embedding_stay_out(setup):
    """Padding rows whose embedding is all zero turn to NaN in the first norm (ε = 1e-20, `MODEL.md` preamble);
    the valid rows and the cache must not notice: segments of 5 in the 17-row program still equal one pass."""
    cfg, _, ids, _ = setup
    flat = random_weights(cfg, 0)
    flat["embed.weight"][2] = 0.0  # the pad id `Runner` puts in padding rows; the prompt never uses it
    state = model_state(cfg, OPTIONS["off"], flat)
    want = Runner(cfg, OPTIONS["off"], state, rows=TOTAL, max_context=MAX_CONTEXT).prefill(ids, [TOTAL])
    got = Runner(cfg, OPTIONS["off"], state, rows=17, max_context=MAX_CONTEXT).prefill(ids, split_sizes(TOTAL, 5))
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() < 1e-4


def test_query_row_blocks_give_the_same_result(setup, monkeypatch):
    """With a tiny scratch budget the indexer and the XLA attention run over blocks of a few query
    rows (`jax.lax.map`); per-row math is unchanged, so the result equals the one-block run (1e-5)."""
    cfg, states, ids, one_pass = setup
    monkeypatch.setattr(indexer, "SCORE_BUDGET_BYTES", 20_000)  # → blocks of 4–16 rows at 56 rows
    options = ModelOptions(dtype="float32", quant_rounding=False, attention_impl="xla", moe_impl="xla")
    # a distinct (equal) options object would hit the same jit cache: build the program afresh

    graphdef = _graph(cfg, options)
    fn = jax.jit(lambda st, x, c, n: nnx.merge(graphdef, st).forward(x, c, n))
    runner = Runner(cfg, options, states["off"], rows=TOTAL, max_context=MAX_CONTEXT)
    runner.fn = fn
    got = runner.prefill(ids, [TOTAL])
    assert np.abs(got - one_pass["off"]).max() < 1e-5
