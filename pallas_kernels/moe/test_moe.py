"""Routed experts: every registered implementation (``pallas_kernels.registry``: xla, pallas — interpret mode on
CPU) through the one op signature against the f32 gather oracle ``reference.py`` (fresh inputs); then the
kernel's own parts (fp4 decode in registers, the tile plan, the offset guard)."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.formats import decode_fp4, fake_quant_fp8
from pallas_kernels.lowering import NoConcreteTarget, cuda_text
from pallas_kernels.moe import ExpertWeights, grouping, routed_experts
from pallas_kernels.moe import kernel as moe_kernel
from pallas_kernels.moe.grouping import max_tiles, plan_tiles
from pallas_kernels.moe.ops import (
    as_words,
    check_offsets,
    default_config,
    plane_chunks,
    weighted_gather_sum,
)
from pallas_kernels.moe.reference import routed_experts_reference
from pallas_kernels.registry import IMPLEMENTATIONS

LIMIT = 10.0
# bf16 inputs, f32 accumulation on both sides: they differ by summation order and by a bf16 rounding of act
# that can flip between them (the XLA implementation also rounds g and u to bf16), ~1e-3 at most; 1e-2 is the
# contract's bound (docs/PLANNER.md).
REL_TOL = 1e-2

_seed = iter(range(10_000))


def _rng() -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([7, next(_seed)]))


def _routing(rng, n, k, e, hot=None, empty=()):
    """topk_ids [n, k] (distinct per row) and weights [n, k]; ``hot`` takes slot 0 of most rows."""
    allowed = np.array([x for x in range(e) if x not in empty])
    ids = np.stack([rng.choice(allowed, size=k, replace=False) for _ in range(n)])
    if hot is not None:
        rows = rng.random(n) < 0.8
        swap = ids == hot
        ids[rows & ~swap.any(1), 0] = hot
    weights = rng.uniform(0.1, 1.5, size=(n, k)).astype(np.float32)
    return jnp.asarray(ids, jnp.int32), jnp.asarray(weights)


def _bf16_weights(rng, e, f, d):
    def w(*shape):
        return jnp.asarray(rng.normal(0.0, 0.08, shape), jnp.bfloat16)
    return ExpertWeights(w1=w(e, f, d), w3=w(e, f, d), w2=w(e, d, f))


def _fp4_weights(rng, e, f, d):
    def codes(*shape):
        return jnp.asarray(rng.integers(0, 256, shape), jnp.uint8)

    def scale(*shape):
        return jnp.asarray(rng.integers(120, 126, shape), jnp.uint8)
    return ExpertWeights.from_fp4(
        codes(e, f, d // 2), scale(e, f, d // 32), codes(e, f, d // 2), scale(e, f, d // 32),
        codes(e, d, f // 2), scale(e, d, f // 32))


def _x(rng, n, d):
    return jnp.asarray(rng.normal(0.0, 1.0, (n, d)), jnp.bfloat16)


@functools.partial(jax.jit, static_argnames="impl")
def _op(x, ids, w, wts, impl):
    return routed_experts(x, ids, w, wts, swiglu_limit=LIMIT, impl=impl, interpret=True)


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), "non-finite output"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def test_decode_fp4_matches_ml_dtypes():
    rng = _rng()
    codes = rng.integers(0, 256, (3, 4, 32), dtype=np.uint8)
    scales = rng.integers(100, 150, (3, 4, 2), dtype=np.uint8)
    nibbles = np.stack([codes & 0xF, codes >> 4], -1).reshape(3, 4, 64)  # low nibble = even column
    values = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    expect = values * np.repeat(2.0 ** (scales.astype(np.float64) - 127), 32, axis=-1)
    got = np.asarray(decode_fp4(jnp.asarray(codes), jnp.asarray(scales), jnp.bfloat16), np.float64)
    np.testing.assert_array_equal(got, expect)  # every e2m1 x 2^k is exact in bf16


def _all_codes_and_scales():
    nibble = np.arange(16, dtype=np.int32)[:, None].repeat(5, 1)
    scale = np.array([100, 120, 127, 128, 140], np.int32)[None, :].repeat(16, 0)
    expect = nibble.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64) * 2.0 ** (scale - 127.0)
    return nibble, scale, expect


def test_kernel_alu_e2m1_decode_is_exact():
    """The kernel's register decode equals ml_dtypes and the codec's ``decode_fp4`` for every code."""
    nibble, scale, expect = _all_codes_and_scales()
    got = moe_kernel._e2m1_to_bf16(jnp.asarray(nibble), moe_kernel._alu_scale(jnp.asarray(scale)))
    np.testing.assert_array_equal(np.asarray(got, np.float64), expect)
    packed = (nibble[0::2] | nibble[1::2] << 4).T.astype(np.uint8)  # [5 scales, 8 bytes]: codes 0..15 in order
    codec = decode_fp4(jnp.asarray(packed), jnp.asarray(scale[0, :, None], jnp.uint8), jnp.float32)
    np.testing.assert_array_equal(np.asarray(codec, np.float64).T, expect)


def _emulate_plane_ptx(words: int, selector: int, shifts: tuple[int, int], scales: list[int]) -> list[float]:
    """One plane's inline-PTX decode in Python: its integer steps (prmt, shifts, masks) on the register of two code
    words, then the two bf16 products in float64 (exact here). Returns the plane's values of the two words."""
    def prmt(a, sel):
        src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [0, 0, 0, 0]
        return sum(src[(sel >> (4 * i)) & 0x7] << (8 * i) for i in range(4))

    def bf16(bits):
        return float(np.array([bits], np.uint16).view(ml_dtypes.bfloat16)[0])

    t = prmt(words, selector)
    bits = ((((t << shifts[0]) & 0xFFFFFFFF) & moe_kernel.MAG_MASK)
            | (((t << shifts[1]) & 0xFFFFFFFF) & moe_kernel.SIGN_MASK))
    k = bf16(moe_kernel.BF16X2_2_POW_126 & 0xFFFF)
    return [bf16((bits >> 16 * h) & 0xFFFF) * k * 2.0 ** (s - 127) for h, s in enumerate(scales)]


def test_ptx_fp4_decode_constants_emulated():
    """Plane n of a 16-bit code word (the op's view of two code bytes) is its nibble n: the code of column 4k + n."""
    rng = _rng()
    f4 = lambda n: np.asarray(n, np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    for _ in range(64):
        codes = rng.integers(0, 256, 4, dtype=np.uint8)     # two words: columns 0-3 and 4-7
        scales = [int(s) for s in rng.integers(100, 140, 2)]
        nibbles = np.stack([codes & 0xF, codes >> 4], 1).reshape(2, 4)  # [word, column within the word]
        for n, (selector, shifts) in enumerate(moe_kernel.PLANES):
            got = _emulate_plane_ptx(int(codes.view(np.uint32)[0]), selector, shifts, scales)
            np.testing.assert_array_equal(got, f4(nibbles[:, n]) * 2.0 ** (np.array(scales) - 127.0))


@pytest.mark.parametrize("n,k,e,block_m", [(1, 6, 16, 16), (37, 3, 8, 16), (200, 6, 16, 64)])
def test_plan_covers_every_pair_once(n, k, e, block_m):
    rng = _rng()
    ids, _ = _routing(rng, n, k, e, hot=2, empty=(5,))
    ids = ids.at[0, 0].set(-1)  # a dropped pair
    plan = jax.tree.map(np.asarray, jax.jit(plan_tiles, static_argnums=(1, 2))(ids, e, block_m))
    assert plan.tile_count.shape == (max_tiles(n * k, e, block_m),)
    flat = np.asarray(ids).reshape(-1)
    seen = []
    for t in np.nonzero(plan.tile_count)[0]:
        first, count = plan.tile_first[t], plan.tile_count[t]
        assert 0 < count <= block_m
        seen.extend(range(first, first + count))
        tokens = plan.pair_token[first:first + count]
        assert np.all(np.diff(tokens) >= 0)  # stable by token within an expert
    assert len(set(seen)) == len(seen) == int(np.sum(flat >= 0))  # every valid pair's slot in one tile
    if n > 1:
        assert sorted(seen) == list(range(len(seen)))  # sorted plans: the tiles cover the sorted prefix
    for n_i, j in np.ndindex(n, k):
        if flat[n_i * k + j] < 0:
            assert not plan.pair_valid[n_i, j]
            continue
        pos = plan.pair_pos[n_i, j]
        t = np.nonzero((plan.tile_first <= pos) & (pos < plan.tile_first + plan.tile_count))[0]
        assert len(t) == 1 and plan.tile_expert[t[0]] == flat[n_i * k + j]
        assert plan.pair_token[pos] == n_i


def _sorted_plan(bucket: np.ndarray, e: int, block_m: int, n_tiles: int) -> tuple[np.ndarray, ...]:
    """The plan by definition (numpy): a stable argsort by bucket, each expert's run cut into tiles of ``block_m``
    in expert order, unused tiles (count 0) at expert E - 1 from slot 0. Returns (order, pos, tile_expert,
    tile_first, tile_count) as ``grouping._counted_tiles`` does."""
    order = np.argsort(bucket, kind="stable")
    pos = np.empty_like(order)
    pos[order] = np.arange(len(order))
    counts = np.bincount(bucket, minlength=e + 1)[:e]
    tiles = [(ex, int(np.sum(counts[:ex])) + done, min(block_m, counts[ex] - done))
             for ex in range(e) for done in range(0, counts[ex], block_m)]  # (expert, first, count)
    tiles += [(e - 1, 0, 0)] * (n_tiles - len(tiles))
    expert, first, count = (np.asarray(column, np.int32) for column in zip(*tiles))
    return order.astype(np.int32), pos.astype(np.int32), expert, first, count


@pytest.mark.parametrize("n,k,e,block_m", [(1, 6, 256, 16), (8, 6, 256, 16), (3, 6, 8, 16), (40, 6, 16, 32),
                                           (9, 2, 4, 4), (50, 6, 384, 64), (700, 6, 16, 64), (2048, 6, 384, 64)])
def test_plan_is_the_stable_sort_by_expert(n, k, e, block_m):
    """The counting sort (``_counted_tiles``) equals the plan by definition (``_sorted_plan``, numpy), array for
    array: the sorted order, every pair's slot (dropped ones included) and the tile table, with hot and empty
    experts, dropped pairs (ids -1, E and beyond), experts spanning several tiles; over one block (decode sizes),
    over blocks with a partial last one (700 × 6 pairs) and at a release prefill's size (2,048 rows × top-6 of
    384)."""
    rng = _rng()
    for trial in range(3):
        ids, _ = _routing(rng, n, k, e, hot=trial % 3, empty=(1,))
        ids = ids.at[0, 0].set(-1).at[n - 1, k - 1].set(e + trial)
        bucket = jnp.where((ids >= 0) & (ids < e), ids, e).reshape(-1)
        got = jax.tree.map(np.asarray, jax.jit(grouping._counted_tiles, static_argnums=(1, 2))(bucket, e, block_m))
        want = _sorted_plan(np.asarray(bucket), e, block_m, max_tiles(n * k, e, block_m))
        for name, a, b in zip(("order", "pos", "tile_expert", "tile_first", "tile_count"), got, want):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_a_plan_of_no_rows_has_no_tiles():
    plan = plan_tiles(jnp.zeros((0, 6), jnp.int32), 16, 64)
    assert plan.pair_pos.shape == (0, 6) and not np.any(np.asarray(plan.tile_count))


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
def test_one_row_plan_gives_the_sorted_plan_s_result(fmt):
    """A batch-1 decode step's plan is a tile per pair in slot order (``_one_row_plan``, no sort): through both
    kernels and the weighted sum it gives the sorted plan's output bitwise (each tile is computed alone, so the
    order of the tiles cannot matter), with a dropped pair (-1), an id past E and a repeated expert in the row."""
    rng = _rng()
    e, f, d, k = 16, 64, 256, 6
    wts = (_fp4_weights if fmt == "fp4" else _bf16_weights)(rng, e, f, d)
    x = _x(rng, 1, d)
    ids = jnp.asarray([[3, -1, 11, 3, e, 7]], jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.5, (1, k)), jnp.float32)
    cfg = default_config(k, wts)
    one_row = grouping.plan_tiles(ids, e, cfg.block_m)
    assert np.asarray(one_row.tile_count).tolist() == [1, 0, 1, 1, 0, 1]      # a tile per valid pair, in order
    valid = (ids >= 0) & (ids < e)
    order, pos, expert, first, count = grouping._counted_tiles(jnp.where(valid, ids, e).reshape(-1), e, cfg.block_m)
    sorted_plan = grouping.TilePlan(jnp.concatenate([order // k, jnp.zeros((cfg.block_m,), jnp.int32)]),
                                    jnp.where(valid.reshape(-1), pos, k).reshape(1, k), valid,
                                    expert, first, count)
    xb, w_ = (plane_chunks(x, cfg.block_k), as_words(wts)) if wts.is_fp4 else (x, wts)  # the op's operands

    def run(plan):
        act = moe_kernel.gate_up(plan, xb, w_.w1, w_.w3, w_.w1_scale, w_.w3_scale, width=f,
                                 permute_out=wts.is_fp4, limit=LIMIT, cfg=cfg, interpret=True)
        y = moe_kernel.down(plan, act, w_.w2, w_.w2_scale, dim=d, cfg=cfg, interpret=True)
        return np.asarray(weighted_gather_sum(y, plan.pair_pos, plan.pair_valid, w))

    np.testing.assert_array_equal(run(one_row), run(sorted_plan))
    deq = wts.dequantized()
    ref = routed_experts_reference(x, ids, w, deq.w1, deq.w3, deq.w2, swiglu_limit=LIMIT)
    assert _rel_err(run(one_row), ref) <= REL_TOL


def test_reference_matches_per_pair_numpy():
    rng = _rng()
    n, k, e, f, d = 5, 2, 4, 32, 64
    x = _x(rng, n, d)
    ids, w = _routing(rng, n, k, e)
    wts = _bf16_weights(rng, e, f, d)
    xs, w1, w3, w2 = (np.asarray(a, np.float64) for a in (x, wts.w1, wts.w3, wts.w2))
    expect = np.zeros((n, d))
    for i, j in np.ndindex(n, k):
        ex = int(ids[i, j])
        g, u = w1[ex] @ xs[i], w3[ex] @ xs[i]
        g = np.minimum(g, LIMIT)
        act = g / (1 + np.exp(-g)) * np.clip(u, -LIMIT, LIMIT)
        act = act.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
        expect[i] += float(w[i, j]) * (w2[ex] @ act)
    got = routed_experts_reference(x, ids, w, wts.w1, wts.w3, wts.w2, swiglu_limit=LIMIT)
    assert _rel_err(got, expect) < 1e-5  # f32 vs f64 accumulation only


CASES = [
    # name, n, k, e, f, d, hot expert, empty experts
    ("decode-1", 1, 6, 16, 96, 128, None, ()),
    ("decode-2-wide", 2, 6, 16, 64, 512, None, ()),   # decode-sized tiles: two 256-wide K chunks
    ("decode-37-uneven", 37, 4, 8, 160, 128, None, ()),
    ("segment-300", 300, 6, 16, 64, 128, None, ()),
    ("segment-200-f256", 200, 6, 16, 256, 128, None, ()),  # prefill-sized blocks: 128 act columns, 64-wide K
    ("skewed-empty", 160, 2, 8, 96, 128, 3, (5, 6, 7)),
]


@pytest.mark.parametrize("name,n,k,e,f,d,hot,empty", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bf16_op_matches_oracle(impl, name, n, k, e, f, d, hot, empty):
    rng = _rng()
    x = _x(rng, n, d)
    ids, w = _routing(rng, n, k, e, hot=hot, empty=empty)
    if empty:  # also drop some pairs: ids outside [0, E) contribute nothing (the reference ignores them)
        ids = ids.at[::7, 1].set(-1)
    wts = _bf16_weights(rng, e, f, d)
    ref = routed_experts_reference(x, ids, w, wts.w1, wts.w3, wts.w2, swiglu_limit=LIMIT)
    out = _op(x, ids, w, wts, impl)
    assert out.shape == (n, d) and out.dtype == jnp.float32
    assert _rel_err(out, ref) <= REL_TOL


@pytest.mark.parametrize("n,k,e,f,d", [(48, 3, 8, 128, 128), (2, 6, 16, 64, 512), (200, 6, 16, 256, 128),
                                       (9, 2, 4, 32, 64)],
                         ids=["segment", "decode-wide", "segment-f256", "narrow-f32-padded"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_fp4_op_matches_oracle_on_dequantised(impl, n, k, e, f, d):
    rng = _rng()
    x = _x(rng, n, d)
    ids, w = _routing(rng, n, k, e, hot=1, empty=(6,))
    wts = _fp4_weights(rng, e, f, d)
    deq = wts.dequantized()
    ref = routed_experts_reference(x, ids, w, deq.w1, deq.w3, deq.w2, swiglu_limit=LIMIT)
    out = _op(x, ids, w, wts, impl)
    assert _rel_err(out, ref) <= REL_TOL


@pytest.mark.parametrize("n,k,e,f,d", [(48, 3, 8, 128, 128), (2, 6, 16, 64, 512), (200, 6, 16, 256, 128)],
                         ids=["segment", "decode-wide", "segment-f256"])
def test_fp4_weights_first_gives_the_same_sums(n, k, e, f, d):
    """``fp4_weights_first`` computes each tile's products transposed (outᵀ = W·xᵀ, then one transpose), and a
    down K chunk wider than the gate/up programs' columns (``down_block_k``) has act stored in plane order per
    chunk: the same sums as the default, so the same output up to summation order, and the oracle's."""
    rng = _rng()
    x = _x(rng, n, d)
    ids, w = _routing(rng, n, k, e, hot=1, empty=(6,))
    wts = _fp4_weights(rng, e, f, d)
    cfg = dataclasses.replace(default_config(n * k, wts), block_f=64)
    variants = {"second": dict(fp4_weights_first=False, down_block_k=0),  # the order and chunks before
                "first": dict(fp4_weights_first=True, down_block_k=0)}
    if f % 128 == 0:  # act in plane order per down chunk, written by gate/up programs narrower and wider than it
        variants["first, down chunk 128"] = dict(fp4_weights_first=True, down_block_k=128)
        variants["first, BF 128, down chunk 64"] = dict(fp4_weights_first=True, block_f=128, down_block_k=64)
    out = {name: routed_experts(x, ids, w, wts, swiglu_limit=LIMIT, impl="pallas", interpret=True,
                                config=dataclasses.replace(cfg, **fields)) for name, fields in variants.items()}
    deq = wts.dequantized()
    ref = routed_experts_reference(x, ids, w, deq.w1, deq.w3, deq.w2, swiglu_limit=LIMIT)
    for name in variants:
        assert _rel_err(out[name], out["second"]) <= 1e-6, name  # f32 sums of exact products, in another order
        assert _rel_err(out[name], ref) <= REL_TOL, name


def test_default_blocks_the_cases_above_run_with():
    """Decode-sized tiles (BM 16) stream 256-wide K chunks, weights second in both formats; bf16 prefill-sized
    tiles of an F that 128 divides compute 128 act columns from 64-wide K chunks (the ``f256`` cases), other widths
    64 columns from 128-wide chunks; fp4 prefill-sized tiles put the weights first, 64 columns, 128-wide chunks,
    3 stages in both kernels."""
    rng = _rng()
    for weights in (_bf16_weights(rng, 16, 64, 512), _fp4_weights(rng, 16, 64, 512)):
        decode, segment = default_config(2 * 6, weights), default_config(2048 * 6, weights)
        assert (decode.block_m, decode.block_k, decode.gate_up_stages, decode.fp4_weights_first) == (16, 256, 3, False)
        assert (segment.block_m, segment.block_k, segment.fp4_weights_first) == (64, 128, weights.is_fp4)
    wide = default_config(200 * 6, _bf16_weights(rng, 16, 256, 128))
    assert (wide.block_m, wide.block_f, wide.block_k, wide.gate_up_stages) == (64, 128, 64, 4)
    wide_fp4 = default_config(200 * 6, _fp4_weights(rng, 16, 256, 128))
    assert (wide_fp4.block_f, wide_fp4.block_k, wide_fp4.down_chunk, wide_fp4.fp4_weights_first) == (64, 128, 128, True)
    assert (wide_fp4.gate_up_stages, wide_fp4.down_stages) == (3, 3)
    assert default_config(200 * 6, _bf16_weights(rng, 16, 192, 128)).block_f == 64


@pytest.mark.parametrize("field", ["block_f", "block_n", "block_k", "down_block_k"])
def test_a_block_that_does_not_divide_its_width_is_refused(field):
    """A grid of F / BF blocks with BF not dividing F would leave act columns uncomputed (BF 128 at F = 576
    gave a 33 % error on the H200): an explicit config like that is refused, not run; so is an fp4 K chunk
    narrower than four planes of 16 columns."""
    rng = _rng()
    x, (ids, w), wts = _x(rng, 8, 192), _routing(rng, 8, 2, 4), _bf16_weights(rng, 4, 192, 192)
    cfg = dataclasses.replace(default_config(16, wts), **{field: 128})
    with pytest.raises(ValueError, match="not a multiple of the block 128"):
        routed_experts(x, ids, w, wts, swiglu_limit=LIMIT, impl="pallas", config=cfg)
    if field != "block_n":  # fp4 K chunks (BK for gate_up, the down chunk for down) hold whole 32-code scale groups
        fp4 = _fp4_weights(rng, 4, 64, 64)
        cfg = dataclasses.replace(default_config(16, fp4), **{field: 32})
        with pytest.raises(ValueError, match="multiples of 64"):
            routed_experts(_x(rng, 8, 64), ids, w, fp4, swiglu_limit=LIMIT, impl="pallas", config=cfg)


def test_reference_is_the_deprecated_name_of_xla():
    rng = _rng()
    x, (ids, w), wts = _x(rng, 5, 64), _routing(rng, 5, 2, 4), _bf16_weights(rng, 4, 32, 64)
    run = lambda impl: np.asarray(routed_experts(x, ids, w, wts, swiglu_limit=LIMIT, impl=impl))
    np.testing.assert_array_equal(run("reference"), run("xla"))
    with pytest.raises(ValueError, match="xla"):
        run("cuda")


def test_bad_shapes_raise():
    rng = _rng()
    wts = _bf16_weights(rng, 2, 32, 64)
    with pytest.raises(ValueError):
        routed_experts(_x(rng, 3, 32), jnp.zeros((3, 1), jnp.int32), jnp.ones((3, 1)), wts,
                       swiglu_limit=LIMIT)


def test_expert_weights_is_a_pytree():
    wts = _fp4_weights(_rng(), 2, 32, 64)
    leaves, treedef = jax.tree.flatten(wts)
    assert len(leaves) == 6
    assert jax.tree.unflatten(treedef, leaves).is_fp4


def test_offset_guard_refuses_only_what_the_kernels_would_wrap():
    """The Triton lowering's 32-bit offsets wrap for one-byte operands of 2-4 GiB. The kernels see fp4 codes as
    16-bit words, so world 1's full-width codes (384 x 2,304 x 2,560 = 2.11 GiB, refused before the word view)
    pass, as do bf16 operands of any size; a one-byte scale operand of 2-4 GiB (a stack of 32-64 GiB of codes on
    one rank) is refused."""
    def weights(e, f, d, dtype=jnp.uint8):
        pack = 2 if dtype == jnp.uint8 else 1
        shapes = [(e, f, d // pack), (e, f, d // pack), (e, d, f // pack)]
        arrays = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
        if dtype != jnp.uint8:
            return ExpertWeights(*arrays)
        scales = [jax.ShapeDtypeStruct((e, f, d // 32), jnp.uint8)] * 2 + [
            jax.ShapeDtypeStruct((e, d, f // 32), jnp.uint8)]
        return ExpertWeights(arrays[0], arrays[1], arrays[2], *scales)

    check_offsets(weights(384, 2304, 5120))
    check_offsets(weights(384, 2304, 5120, jnp.bfloat16))
    with pytest.raises(ValueError, match="w1_scale of 2.11 GiB"):
        check_offsets(weights(16 * 384, 2304, 5120))  # 16 layers' experts at world 1: 34 GiB of codes a matrix


def test_layers_calling_the_op_alike_lower_its_kernels_once():
    """The model calls the op once a layer with the same shapes: one program lowers its two Triton kernels once,
    not once a call (the 40-layer decode step: 32 → 10 Pallas custom calls, trace + lower 2.35–2.70 → 1.79–1.99 s
    on this repository's CPU host, lowered for CUDA). Lowered here for CUDA without a GPU (``interpret=False``)."""
    rng = _rng()
    w = _bf16_weights(rng, 16, 64, 128)
    ids, wts = _routing(rng, 1, 6, 16)

    def two_layers(x):
        y = routed_experts(x, ids, wts, w, swiglu_limit=LIMIT, impl="pallas", interpret=False)
        return routed_experts(y.astype(x.dtype), ids, wts, w, swiglu_limit=LIMIT, impl="pallas", interpret=False)

    try:
        text = cuda_text(two_layers, _x(rng, 1, 128), concrete=True)
    except NoConcreteTarget:
        pytest.skip("lowering for CUDA here needs an abstract device, under which each call lowers its own copy")
    assert text.count("stablehlo.custom_call") == 2  # gate_up and down, once each


def _stack(layers: list) -> ExpertWeights:
    return jax.tree.map(lambda *a: jnp.stack(a), *layers)


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("n", [2, 48], ids=["decode", "segment"])
def test_a_layer_of_a_stack_equals_the_layer_alone(impl, fmt, n):
    """A scanned unit passes its whole stack of experts [L, E, ...] and the layer's row (the kernel reads expert
    e of the layer at row·E + e in place): the result equals the op on that layer's experts alone, for each row,
    dropped pairs (id -1) included. The same tiles, operands and products; two programs XLA:CPU compiles apart
    may order an f32 dot's sum differently (seen: ≤ 7.6e-6 absolute on outputs of norm ~50, f32 rounding of
    sums of such terms), hence a relative error ≤ 1e-6 of the whole output; a wrong expert is off by O(1)."""
    rng = _rng()
    make = _fp4_weights if fmt == "fp4" else _bf16_weights
    e, f, d = 8, 64, 128
    layers = [make(rng, e, f, d) for _ in range(3)]
    x = _x(rng, n, d)
    ids, w = _routing(rng, n, 3, e, hot=2)
    ids = ids.at[::5, 1].set(-1)
    stack = _stack(layers)
    run = jax.jit(lambda x, stack, row: routed_experts(x, ids, w, stack, swiglu_limit=LIMIT, impl=impl,
                                                      interpret=True, row=row))
    for row in range(3):
        alone = _op(x, ids, w, layers[row], impl)
        assert _rel_err(run(x, stack, jnp.int32(row)), alone) <= 1e-6


def test_a_stack_needs_its_layer_axis():
    rng = _rng()
    w = _bf16_weights(rng, 8, 64, 128)
    ids, wts = _routing(rng, 2, 3, 8)
    with pytest.raises(ValueError, match="not a stack of layers"):
        routed_experts(_x(rng, 2, 128), ids, wts, w, swiglu_limit=LIMIT, impl="pallas", interpret=True,
                       row=jnp.int32(0))


def test_a_stack_is_read_in_place():
    """Lowered for CUDA (no GPU needed): the kernels take the whole stack, seen as [L·E, ...] (a reshape, no
    copy); no slice of it is made (a layer's slice would copy all its experts every call)."""
    rng = _rng()
    stack = _stack([_bf16_weights(rng, 8, 64, 128) for _ in range(4)])
    ids, wts = _routing(rng, 1, 3, 8)

    def layer(x, stack, row):
        return routed_experts(x, ids, wts, stack, swiglu_limit=LIMIT, impl="pallas", interpret=False, row=row)

    text = cuda_text(layer, _x(rng, 1, 128), stack, jnp.int32(2))
    assert "tensor<32x64x128xbf16>" in text                        # the stack as 32 experts, passed whole
    assert "dynamic_slice" not in text and "tensor<8x64x128xbf16>" not in text   # never one layer's slice


@pytest.mark.parametrize("layers", [4, 12])
def test_fp4_stacks_are_read_in_placeas_words(layers):
    """Lowered for CUDA (abstract shapes, no memory): the release's fp4 experts at world 4 (384 experts at the
    padded F = 640, 629 MB of codes a matrix a layer) as a stack of 4 layers (2.5 GB: one-byte offsets would wrap)
    or 12 (7.5 GB) are passed whole as 16-bit words [L·E, F, D/4] (a view of the bytes); no expert and no layer
    is copied out of them."""
    e, f, d = 384, 640, 5120
    u8 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.uint8)
    stack = ExpertWeights(u8(layers, e, f, d // 2), u8(layers, e, f, d // 2), u8(layers, e, d, f // 2),
                          u8(layers, e, f, d // 32), u8(layers, e, f, d // 32), u8(layers, e, d, f // 32))
    ids, wts = _routing(_rng(), 1, 6, e)

    def layer(x, stack, row):
        return routed_experts(x, ids, wts, stack, swiglu_limit=LIMIT, impl="pallas", interpret=False, row=row)

    x = jax.ShapeDtypeStruct((1, d), jnp.bfloat16)
    text = cuda_text(layer, x, stack, jnp.int32(1))
    assert f"tensor<{layers * e}x{f}x{d // 4}xui16>" in text      # the stack, whole, as words
    code_arrays = re.findall(rf"tensor<(\d+)x{f}x(?:{d // 4}xui16|{d // 2}xui8|{d // 4}x2xui8)>", text)
    assert set(code_arrays) == {str(layers * e)}                 # never fewer experts: nothing copied out of it


def _random_stack(key, fmt: str, layers: int, e: int, f: int, d: int) -> ExpertWeights:
    """Drawn on the device a tensor at a time, each in one program: codes as random bytes, bf16 weights cast where
    they are drawn (drawn eagerly, a 6.8 GB code tensor went through a 27 GB int32 one)."""
    k1, k2, k3 = jax.random.split(key, 3)
    if fmt == "bf16":
        w = jax.jit(lambda k, *s: (jax.random.normal(k, s, jnp.float32) * 0.02).astype(jnp.bfloat16),
                    static_argnums=tuple(range(1, 5)))
        return ExpertWeights(w(k1, layers, e, f, d), w(k2, layers, e, f, d), w(k3, layers, e, d, f))
    codes = jax.jit(lambda k, *s: jax.random.bits(k, s, jnp.uint8), static_argnums=tuple(range(1, 5)))
    scales = lambda *s: jnp.full(s, 121, jnp.uint8)
    return ExpertWeights.from_fp4(codes(k1, layers, e, f, d // 2), scales(layers, e, f, d // 32),
                                  codes(k2, layers, e, f, d // 2), scales(layers, e, f, d // 32),
                                  codes(k3, layers, e, d, f // 2), scales(layers, e, d, f // 32))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernels' addressing of large stacks")
@pytest.mark.gpu_memory  # ~22 GB resident: `make test-gpu` runs these alone, after the shared pass
@pytest.mark.parametrize("fmt,layers,e,f,rows", [
    ("bf16", 12, 24, 2304, 1), ("bf16", 12, 24, 2304, 64),    # 6.8 GB a tensor: 64-bit offsets, read in place
    ("fp4", 12, 96, 2304, 8),                                    # 6.8 GB of codes
    ("fp4", 4, 384, 576, 1), ("fp4", 4, 384, 576, 8)])          # 2.26 GB of codes (one-byte offsets would wrap)
def test_large_stacks_on_the_gpu_equal_the_layer_alone(fmt, layers, e, f, rows):
    """On the GPU, the compiled kernels (not interpret mode) on stacks read in place past the lowering's 32-bit
    offsets and, for fp4 codes as 16-bit words, where one-byte offsets would wrap (2-4 GiB): layers 0, the middle
    and the last equal the op on that layer alone, bitwise."""
    d = 5120
    stack = _random_stack(jax.random.key(0), fmt, layers, e, f, d)
    x = (jax.random.normal(jax.random.key(1), (rows, d), jnp.float32)).astype(jnp.bfloat16)
    ids = jnp.stack([jax.random.permutation(jax.random.key(2 + i), e)[:6] for i in range(rows)]).astype(jnp.int32)
    w = jnp.full((rows, 6), 0.3, jnp.float32)
    stacked = jax.jit(lambda x, st, r: routed_experts(x, ids, w, st, swiglu_limit=LIMIT, row=r))
    alone = jax.jit(lambda x, one: routed_experts(x, ids, w, one, swiglu_limit=LIMIT))
    for row in (0, layers // 2, layers - 1):
        one = jax.tree.map(lambda a: a[row], stack)
        np.testing.assert_array_equal(np.asarray(stacked(x, stack, jnp.int32(row))), np.asarray(alone(x, one)))
        del one


FP8_CASES = [(48, 3, 8, 128, 128), (2, 6, 16, 64, 512), (200, 6, 16, 256, 128), (37, 4, 8, 160, 128)]


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
@pytest.mark.parametrize("n,k,e,f,d", FP8_CASES, ids=["segment", "decode-wide", "segment-f256", "uneven-f160"])
def test_fp8_gemm_inputs_both_implementations_agree(fmt, n, k, e, f, d):
    """``gemm_inputs="fp8"``: x and the weighted act rounded to e4m3 + ue8m0 per 32 (the weight applied before w2).
    With float32 x both implementations form the same values: x's rounded values are exact in bf16 (the kernel's
    operands), g and u are f32 sums of exact products, act · w is f32 on both sides and rounded from f32 (the
    kernel stores act in x's dtype in this mode), and the rounded act is exact in bf16 again — so they differ by
    the order of f32 sums only (measured ≤ 1e-7 of the output's norm; one act value crossing an e4m3 boundary on
    a last-bit difference would cost ~1e-4), with dropped pairs, hot and empty experts, fp4 act in plane order
    per down chunk (segment-f256: 64-column programs, 128-wide chunks). The mode is not the exact one: ~5 %."""
    rng = _rng()
    x = jnp.asarray(rng.normal(0.0, 1.0, (n, d)), jnp.float32)
    ids, w = _routing(rng, n, k, e, hot=1, empty=(6,))
    ids = ids.at[::7, 1].set(-1)
    wts = (_fp4_weights if fmt == "fp4" else _bf16_weights)(rng, e, f, d)
    run = lambda impl, mode: routed_experts(x, ids, w, wts, swiglu_limit=LIMIT, impl=impl, interpret=True,
                                            gemm_inputs=mode)
    xla, pallas = run("xla", "fp8"), run("pallas", "fp8")
    assert pallas.shape == (n, d) and pallas.dtype == jnp.float32
    assert _rel_err(pallas, xla) <= 1e-6
    assert _rel_err(xla, run("xla", "exact")) > 0.02


def test_fp8_gemm_inputs_round_the_weighted_act_of_the_release():
    """The XLA implementation's fp8 mode is, pair by pair in numpy terms: y_n = Σ_j fp8(f32(w·act(fp8(x)))) · w2ᵀ
    with fp8 = ``formats.fake_quant_fp8`` (the rounding tests/test_gemm_inputs.py holds to mlx-vlm's bit for bit);
    f32 vs f64 accumulation only."""
    rng = _rng()
    n, k, e, f, d = 6, 2, 4, 64, 64
    x = jnp.asarray(rng.normal(0.0, 1.0, (n, d)), jnp.float32)
    ids, w = _routing(rng, n, k, e)
    wts = _bf16_weights(rng, e, f, d)
    xs = np.asarray(fake_quant_fp8(x), np.float64)
    w1, w3, w2 = (np.asarray(a, np.float64) for a in (wts.w1, wts.w3, wts.w2))
    expect = np.zeros((n, d))
    for i, j in np.ndindex(n, k):
        ex = int(ids[i, j])
        g, u = np.minimum(w1[ex] @ xs[i], LIMIT), np.clip(w3[ex] @ xs[i], -LIMIT, LIMIT)
        act = np.asarray(fake_quant_fp8(jnp.asarray(float(w[i, j]) * g / (1 + np.exp(-g)) * u, jnp.float32)))
        expect[i] += w2[ex] @ act.astype(np.float64)
    got = routed_experts(x, ids, w, wts, swiglu_limit=LIMIT, impl="xla", gemm_inputs="fp8")
    assert _rel_err(got, expect) < 1e-5


def test_fp8_gemm_inputs_need_whole_blocks_of_f():
    rng = _rng()
    wts = _bf16_weights(rng, 4, 48, 64)
    ids, w = _routing(rng, 3, 2, 4)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        routed_experts(_x(rng, 3, 64), ids, w, wts, swiglu_limit=LIMIT, impl="xla", gemm_inputs="fp8")
    with pytest.raises(ValueError, match="gemm_inputs 'fp4'"):
        routed_experts(_x(rng, 3, 64), ids, w, wts, swiglu_limit=LIMIT, gemm_inputs="fp4")


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
def test_fp8_gemm_inputs_lower_for_cuda(fmt):
    """Lowered for CUDA without a GPU (``interpret=False``): the fp8 mode's gate/up kernel (the pairs' weights
    loaded with the tile's rows, act stored in x's dtype) and down kernel lower, still two Triton calls."""
    rng = _rng()
    w = (_fp4_weights if fmt == "fp4" else _bf16_weights)(rng, 16, 128, 128)
    ids, wts = _routing(rng, 64, 6, 16)
    layer = lambda x: routed_experts(x, ids, wts, w, swiglu_limit=LIMIT, impl="pallas", interpret=False,
                                     gemm_inputs="fp8")
    text = cuda_text(layer, _x(rng, 64, 128))
    assert text.count("stablehlo.custom_call") == 2
