"""Sparse attention: every registered implementation (``pallas_kernels.registry``: xla, pallas — interpret mode on
CPU, compiled on a GPU) against the gather oracle ``reference.py`` run in float32, through the one op signature;
then the kernel's own properties (tilings, head tiles; its output buffer poisoned with NaN so an unwritten element
fails).

Every case draws fresh random inputs and compares against the oracle run on the same values upcast to float32.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.registry import IMPLEMENTATIONS
from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.sparse_attention.kernel import key_splits, sparse_attention_pallas
from pallas_kernels.sparse_attention.reference import sparse_attention_reference

INTERPRET = jax.default_backend() != "gpu"
# bf16 inputs, bf16 output (rounding 2^-9 relative) and bf16 probabilities in the P·V dot (2^-9 each) give
# about 3e-3 relative error against a float32 reference; the contract's bound is 1e-2 (PLANNER.md §D).
REL_TOL = 1e-2


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int = 1
    rows: int = 5
    heads: int = 4
    head_dim: int = 128
    pool: int = 64
    topk: int = 40
    window: int = 16
    first_pos: tuple[int, ...] = (0,)
    q_gain: float = 1.0   # > 1 sharpens the softmax, so the running max matters


def make_inputs(case: Case, seed: int):
    """Random inputs for `case`; returns the tuple of sparse_attention's positional arguments.

    Sequence b's rows sit at first_pos[b] + t. Its window buffer starts 0-2 rows later than the earliest
    position its first row could see, so some early rows miss part of their window; positions < 0 are invalid.
    Row 1 has an empty compressed list and ~20 % of the other entries are -1.
    """
    rng = np.random.default_rng(seed)
    b, t, h, d, w = case.batch, case.rows, case.heads, case.head_dim, case.window
    first = np.resize(np.asarray(case.first_pos, np.int64), b)
    q = rng.standard_normal((b, t, h, d)) * case.q_gain
    pool = rng.standard_normal((b, case.pool, d))
    topk = rng.integers(0, case.pool, (b, t, case.topk))
    topk = np.where(rng.random(topk.shape) < 0.2, -1, topk)
    if t > 1:
        topk[:, 1, :] = -1
    window_start = first - (w - 1) + rng.integers(0, 3, b)
    window = rng.standard_normal((b, t + w - 1, d))
    q_pos = first[:, None] + np.arange(t)
    sinks = rng.standard_normal(h) * 2.0
    bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    return (bf16(q), bf16(pool), i32(topk), bf16(window), i32(window_start), i32(q_pos),
            jnp.asarray(sinks, jnp.float32))


def reference_f32(args, window: int):
    return np.asarray(_reference_f32(tuple(args), window))


@functools.partial(jax.jit, static_argnums=1)
def _reference_f32(args, window: int):
    """The oracle as one program (op by op, its first call per shape compiled each op: ~1.5 s a case)."""
    upcast = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    return sparse_attention_reference(*upcast, window_size=window, scale=args[0].shape[-1] ** -0.5)


def run_op(impl: str, args, window: int):
    """The op (``impl``) on ``args``, as float32 numpy."""
    out = sparse_attention(*args, window_size=window, scale=args[0].shape[-1] ** -0.5, impl=impl,
                           interpret=INTERPRET)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    return np.asarray(out.astype(jnp.float32))


def run_kernel(args, window: int, head_tile=None, tiling=(None, None, None), splits=None):
    """The kernel on a NaN-poisoned output buffer; tiling = (key_tile, num_warps, num_stages), None = default;
    splits: programs per (head tile, row) over the keys (None: the kernel's choice by rows)."""
    poison = jnp.full(args[0].shape, jnp.nan, args[0].dtype)
    key_tile, num_warps, num_stages = tiling
    out = sparse_attention_pallas(*args, poison, window_size=window, scale=args[0].shape[-1] ** -0.5,
                                  head_tile=head_tile, key_tile=key_tile, num_warps=num_warps,
                                  num_stages=num_stages, splits=splits, interpret=INTERPRET)
    return np.asarray(out.astype(jnp.float32))


def assert_close(out, ref):
    assert np.isfinite(out).all(), "output has NaN/inf (unwritten or poisoned elements)"
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err <= REL_TOL, f"relative error {err:.2e} > {REL_TOL}"
    # Per (row, head) too, so one wrong row cannot hide in the global norm (same bf16 error budget, 3x slack).
    row_err = np.linalg.norm(out - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-6)
    assert row_err.max() <= 3 * REL_TOL, f"worst (row, head) relative error {row_err.max():.2e}"


CASES = {
    "H1_start_of_sequence": Case(batch=2, rows=5, heads=1, first_pos=(0, 3)),
    "H3_deep_ragged_window": Case(rows=7, heads=3, topk=64, window=20, first_pos=(300_000,)),
    "H8_full_dims": Case(rows=3, heads=8, head_dim=512, pool=96, topk=48, window=128, first_pos=(1000,)),
    "H16_mixed_depths": Case(batch=2, rows=6, heads=16, topk=32, first_pos=(300_005, 2), q_gain=3.0),
    "H48_tail_tile_no_compressed": Case(rows=3, heads=48, head_dim=64, topk=0, first_pos=(40,)),
    "H64_deep": Case(rows=2, heads=64, head_dim=64, topk=33, window=24, first_pos=(310_000,)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_op_matches_oracle(impl, name):
    """The shared suite: each implementation of the op computes the oracle's function."""
    case = CASES[name]
    args = make_inputs(case, seed=zlib.crc32(name.encode()))
    assert_close(run_op(impl, args, case.window), reference_f32(args, case.window))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_window_only_layer(impl):
    """kv_pool = topk = None (a layer without compressed entries) = an oracle call whose picks are all −1."""
    case = Case(rows=3, heads=4, head_dim=64, first_pos=(9,))
    q, pool, topk, window, window_start, q_pos, sinks = make_inputs(case, seed=21)
    out = sparse_attention(q, None, None, window, window_start, q_pos, sinks, window_size=case.window,
                           scale=case.head_dim ** -0.5, impl=impl, interpret=INTERPRET)
    none = (q, pool, jnp.full_like(topk, -1), window, window_start, q_pos, sinks)
    assert_close(np.asarray(out, np.float32), reference_f32(none, case.window))


@pytest.mark.parametrize("tiling", [(16, 4, 3), (32, 4, 2)])
@pytest.mark.parametrize("splits", [1, None])
def test_other_key_tiles(tiling, splits):
    """The benchmark's alternative tilings compute the same function (ragged last compressed/window tile), with
    the keys in one program per (head tile, row) or split over several."""
    case = Case(rows=3, heads=16, head_dim=64, topk=70, window=20, first_pos=(30,))
    args = make_inputs(case, seed=tiling[0])
    assert_close(run_kernel(args, case.window, tiling=tiling, splits=splits), reference_f32(args, case.window))


def test_key_splits_of_decode_rows():
    """Launches of at most 8 rows split every key tile off (a 512-pick, 128-window decode row: 10 tiles of 64
    keys), prefill segments do not; any split count — one a tile (some splits only window keys, the row's
    compressed list empty or its window cut), or runs of several tiles — gives the oracle's values, and the same
    as one program up to the f32 join's rounding; a row without any valid key stays exactly zero."""
    assert key_splits(1, 10) == 10 and key_splits(8, 10) == 10 and key_splits(9, 10) == 1
    assert key_splits(2048, 10) == 1
    case = Case(rows=4, heads=16, head_dim=64, topk=70, window=20, first_pos=(30,), q_gain=3.0)
    q, pool, topk, window, window_start, q_pos, sinks = make_inputs(case, seed=5)
    q_pos = q_pos.at[0, 3].set(-1)
    topk = topk.at[0, 3].set(-1)            # row 3 sees no key; row 1's compressed list is empty
    args = (q, pool, topk, window, window_start, q_pos, sinks)
    ref = reference_f32(args, case.window)
    one = run_kernel(args, case.window, tiling=(16, 4, 3), splits=1)
    assert_close(one, ref)
    for splits in (None, 3, 5):            # 7 tiles of 16 keys: 7 splits, runs of 3 and of 2
        out = run_kernel(args, case.window, tiling=(16, 4, 3), splits=splits)
        assert_close(out, ref)
        assert (out[0, 3] == 0).all()
        np.testing.assert_allclose(out, one, rtol=2**-7, atol=2**-7 * np.abs(one).max())


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_rows_without_keys_are_zero(impl):
    """Padding rows (q_pos = -1, empty compressed list) see no key: the output must be exactly zero."""
    case = CASES["H1_start_of_sequence"]   # same shapes as that case: reuses its compiled kernel
    q, pool, topk, window, window_start, q_pos, sinks = make_inputs(case, seed=11)
    q_pos = q_pos.at[0, 2:].set(-1)
    topk = topk.at[0, 2:].set(-1)
    args = (q, pool, topk, window, window_start, q_pos, sinks)
    out = run_kernel(args, case.window) if impl == "pallas" else run_op(impl, args, case.window)
    assert np.isfinite(out).all()
    assert (out[0, 2:] == 0).all()
    assert_close(out, reference_f32(args, case.window))


def test_head_tile_invariance_bitwise():
    """PLANNER.md §D rule 3: a (row, head) result does not depend on the head tile (BMQ 8, 16, 32).

    40 heads: a masked tail tile at every tile size; a sharp softmax and 70 compressed keys (ragged tile)."""
    case = Case(rows=3, heads=40, head_dim=64, topk=70, first_pos=(77,), q_gain=4.0)
    args = make_inputs(case, seed=40)
    outs = {tile: run_kernel(args, case.window, head_tile=tile) for tile in (8, 16, 32)}
    assert_close(outs[32], reference_f32(args, case.window))
    np.testing.assert_array_equal(outs[16], outs[32])
    np.testing.assert_array_equal(outs[8], outs[32])


def test_reference_matches_float64_loop():
    """The reference itself against a direct float64 transcription of MODEL.md §B.6, key by key."""
    case = Case(batch=2, rows=4, heads=2, head_dim=16, pool=10, topk=6, window=5, first_pos=(2, 300_000))
    args = make_inputs(case, seed=5)
    q, pool, topk, window, window_start, q_pos, sinks = (np.asarray(a, np.float64) for a in args)
    expected = np.zeros(q.shape)
    for b in range(case.batch):
        for t in range(case.rows):
            p = int(q_pos[b, t])
            keys = [pool[b, int(j)] for j in topk[b, t] if j >= 0]
            for pos in range(max(0, p - case.window + 1), p + 1):
                row = pos - int(window_start[b])
                if 0 <= row < window.shape[1]:
                    keys.append(window[b, row])
            for h in range(case.heads):
                if not keys:
                    continue
                logits = np.array([q[b, t, h] @ k for k in keys]) / np.sqrt(case.head_dim)
                m = max(logits.max(), sinks[h])
                weights = np.exp(logits - m)
                expected[b, t, h] = weights @ np.array(keys) / (weights.sum() + np.exp(sinks[h] - m))
    np.testing.assert_allclose(reference_f32(args, case.window), expected, rtol=1e-5, atol=1e-6)


def test_xla_row_blocks_bitwise():
    """The XLA implementation's blocks of query rows (a scratch budget) do not change a single bit."""
    case = Case(rows=7, heads=3, head_dim=32, topk=20, window=8, first_pos=(50,))
    args = make_inputs(case, seed=7)
    kw = dict(window_size=case.window, scale=case.head_dim ** -0.5, impl="xla")
    whole = np.asarray(sparse_attention(*args, **kw), np.float32)
    for block in (1, 3):
        np.testing.assert_array_equal(np.asarray(sparse_attention(*args, **kw, rows_per_block=block), np.float32),
                                      whole)


def test_ops_names_and_errors():
    """"reference" is the deprecated name of "xla"; an unknown impl or a wrong shape is a clear ValueError."""
    case = Case(rows=3, heads=6, head_dim=64, first_pos=(20,))
    args = make_inputs(case, seed=3)
    kw = dict(window_size=case.window, scale=case.head_dim ** -0.5)
    np.testing.assert_array_equal(np.asarray(sparse_attention(*args, **kw, impl="reference"), np.float32),
                                  np.asarray(sparse_attention(*args, **kw, impl="xla"), np.float32))
    with pytest.raises(ValueError, match="xla | pallas"):
        sparse_attention(*args, **kw, impl="cuda")
    with pytest.raises(ValueError, match="sinks"):
        sparse_attention(*args[:-1], args[-1][:2], **kw)
