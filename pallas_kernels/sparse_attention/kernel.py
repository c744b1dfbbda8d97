"""Pallas (Triton lowering) kernel: fused sparse prefill attention (PLANNER.md §D, MODEL.md §B.6).

One program per (head tile j, query row t, sequence b), or, for launches of at most SPLIT_ROWS rows (decode), per
(head tile, key tile, row, sequence): each split runs the online softmax over its key tile and stores its state
(f32 numerator, max, denominator: rows · tiles · H · Dh · 4 bytes, 10 MB at 8 rows, 10 tiles, H = 64,
Dh = 512), and ``_combine`` joins them with the sink as ``_finish`` does for one. It loads `lanes` query heads
once, then walks the row's keys in tiles of `key_tile`: the compressed entries the indexer picked (gathered from
the pool, list order), then the row's window slice (ascending positions), with one online softmax in float32
(base 2). The sink joins the denominator last, then 1/l (PLANNER §D rule 4). V = K, so each key tile serves both
dots.

Head tiling (PLANNER §D rules 1-3): tile j covers heads [j·head_tile, j·head_tile + head_tile); the MMA tile
has `lanes` = max(16, next_pow2(head_tile)) rows, and rows beyond the tile or beyond H are masked (zero query,
no store). Every reduction over keys that could depend on the tile's row count is done by the MMA (row sums
via a dot with ones) or is exact (max), so a (row, head) result does not depend on head_tile.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)
# Running max before any valid key: finite, so exp2(m_old - m_new) never sees (-inf) - (-inf).
_M_INIT = -1e30
SPLIT_ROWS = 8  # launches of at most this many rows split each row's key tiles over programs (``key_splits``)


HIGHEST = lax.Precision.HIGHEST


def lanes_for(head_tile: int) -> int:
    """MMA rows for a head tile: a power of two, at least 16 (PLANNER §D rule 2)."""
    return max(16, pl.next_power_of_2(head_tile))


def default_tiling(lanes: int) -> tuple[int, int, int]:
    """(key_tile, num_warps, num_stages) for an MMA tile of `lanes` rows.

    64-key tiles, 4 warps, 2 stages were the fastest of the tilings tried at 16 and 32 rows (measured: see
    docs/BENCHMARKS.md, section "Fused sparse prefill attention")."""
    del lanes  # the same tiling won at both row counts
    return (64, 4, 2)


def _online_softmax_step(carry, q, keys, key_ok, scale_log2):
    """One key tile of the online softmax.

    carry: (m [L] running max (log2 units), l [L] running denominator, acc [L, Dh] running numerator);
    q: [L, Dh]; keys: [KT, Dh] (masked rows zero); key_ok: [KT] bool.
    """
    m_old, l_old, acc_old = carry
    # precision=HIGHEST: full-f32 (IEEE) MMAs when a float32 model calls the kernel (Triton's default for
    # f32 operands is TF32); bf16 operands are unaffected.
    logits = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                             precision=HIGHEST)
    logits = jnp.where(key_ok[None, :], logits * scale_log2, -jnp.inf)          # [L, KT]
    m_new = jnp.maximum(m_old, logits.max(axis=1))                             # max is exact in any order
    alpha = jnp.exp2(m_old - m_new)
    probs = jnp.exp2(logits - m_new[:, None]).astype(keys.dtype)               # [L, KT]
    # Row sums through the MMA (a dot with ones) so the summation order is the MMA's fixed K order, not a
    # layout-dependent tree reduction; every column holds the same sum, so max picks it exactly.
    ones = jnp.ones((keys.shape[0], 16), keys.dtype)
    row_sum = jnp.dot(probs, ones, preferred_element_type=jnp.float32, precision=HIGHEST).max(axis=1)
    l_new = l_old * alpha + row_sum
    acc_new = acc_old * alpha[:, None] + jnp.dot(probs, keys, preferred_element_type=jnp.float32,
                                                 precision=HIGHEST)
    return m_new, l_new, acc_new


def _kernel(q_pos_ref, first_row_ref, q_ref, pool_ref, topk_ref, window_ref, sinks_ref, *rest,
            num_heads: int, head_tile: int, lanes: int, window_size: int, key_tile: int,
            num_comp_tiles: int, scale_log2: float, splits: int):
    """Refs: q_pos, first_row: [] int32; q: [H, Dh]; pool: [N, Dh]; topk: [Kp] int32; window: [S, Dh];
    sinks: [H] f32; rest = ([aliased poison input,] o: [H, Dh]), or with ``splits`` > 1 (program axis 0 =
    head tile · splits + split) this split's (acc: [H, Dh] f32, m: [H] f32, l: [H] f32) before the sink."""
    head_dim = q_ref.shape[-1]
    num_rows = window_ref.shape[0]
    h0 = (pl.program_id(0) // splits) * head_tile
    lane = jnp.arange(lanes)
    head_ok = (lane < head_tile) & (h0 + lane < num_heads)                      # [L]
    q = plgpu.load(q_ref.at[pl.ds(h0, lanes), :], mask=head_ok[:, None], other=0)
    cols = jnp.arange(head_dim)[None, :]
    tile_iota = jnp.arange(key_tile)
    step = functools.partial(_online_softmax_step, q=q, scale_log2=scale_log2)

    def compressed_tile(c, carry):
        idx = topk_ref[pl.ds(c * key_tile, key_tile)]                           # [KT], -1 = none
        ok = idx >= 0
        rows = jnp.where(ok, idx, 0)
        keys = plgpu.load(pool_ref.at[rows[:, None], cols], mask=ok[:, None], other=0)
        return step(carry, keys=keys, key_ok=ok)

    q_pos = q_pos_ref[()]
    first_row = first_row_ref[()]   # window row of position q_pos - (window_size - 1)

    def window_tile(w, carry):
        k = w * key_tile + tile_iota                                            # key k is at q_pos - W + 1 + k
        rows = first_row + k
        ok = (k < window_size) & (k >= window_size - 1 - q_pos) & (rows >= 0) & (rows < num_rows)
        keys = plgpu.load(window_ref.at[jnp.where(ok, rows, 0)[:, None], cols], mask=ok[:, None], other=0)
        return step(carry, keys=keys, key_ok=ok)

    carry = (jnp.full((lanes,), _M_INIT, jnp.float32), jnp.zeros((lanes,), jnp.float32),
             jnp.zeros((lanes, head_dim), jnp.float32))
    window_tiles = pl.cdiv(window_size, key_tile)
    if splits == 1:
        carry = lax.fori_loop(0, num_comp_tiles, compressed_tile, carry)
        carry = lax.fori_loop(0, window_tiles, window_tile, carry)
        _finish(carry, sinks_ref, rest[-1], h0=h0, lanes=lanes, head_ok=head_ok)
        return
    # this split's run of the key tiles: the compressed ones, then the window's
    per_split = pl.cdiv(num_comp_tiles + window_tiles, splits)
    first = (pl.program_id(0) % splits) * per_split
    last = first + per_split
    carry = lax.fori_loop(jnp.minimum(first, num_comp_tiles), jnp.minimum(last, num_comp_tiles),
                          compressed_tile, carry)
    carry = lax.fori_loop(jnp.clip(first - num_comp_tiles, 0, window_tiles),
                          jnp.clip(last - num_comp_tiles, 0, window_tiles), window_tile, carry)
    m, den, acc = carry
    acc_ref, m_ref, l_ref = rest
    plgpu.store(acc_ref.at[pl.ds(h0, lanes), :], acc, mask=head_ok[:, None])
    plgpu.store(m_ref.at[pl.ds(h0, lanes)], m, mask=head_ok)
    plgpu.store(l_ref.at[pl.ds(h0, lanes)], den, mask=head_ok)


def _finish(carry, sinks_ref, o_ref, *, h0, lanes: int, head_ok):
    """The sink joins the denominator, then 1/den; rows without a valid key are zeros."""
    m, den, acc = carry
    sink = plgpu.load(sinks_ref.at[pl.ds(h0, lanes)], mask=head_ok, other=0.0) * LOG2E
    m_final = jnp.maximum(m, sink)
    rescale = jnp.exp2(m - m_final)
    denominator = den * rescale + jnp.exp2(sink - m_final)
    out = acc * (rescale / denominator)[:, None]
    out = jnp.where((den > 0)[:, None], out, 0.0)                               # no valid key -> zeros
    plgpu.store(o_ref.at[pl.ds(h0, lanes), :], out.astype(o_ref.dtype), mask=head_ok[:, None])


def key_splits(rows: int, key_tiles: int) -> int:
    """Programs per (head tile, row) over the row's key tiles: one per key tile in launches of at most
    SPLIT_ROWS rows (decode, a speculative verify), where one program per head tile walked all of a row's ~10
    key tiles alone (latency-bound), else 1. Every split launch cuts a
    row's keys the same way, so a row's result does not depend on the batch up to SPLIT_ROWS rows, nor on the
    head tile (PLANNER §D rule 3); a launch of more rows rounds its join differently (f32, within 2^-7 relative
    in the tests)."""
    return key_tiles if rows <= SPLIT_ROWS else 1


@functools.partial(jax.jit, static_argnames=(
    "window_size", "scale", "head_tile", "key_tile", "num_warps", "num_stages", "splits", "interpret"))
def sparse_attention_pallas(q, kv_pool, topk, window, window_start, q_pos, sinks, out_init=None, *,
                            window_size: int, scale: float, head_tile: int | None = None,
                            key_tile: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None, splits: int | None = None,
                            interpret: bool = False):
    """Pallas sparse attention; contract of `ops.sparse_attention` (shapes checked there).

    q: [B, T, H, Dh] (Dh a power of two >= 16); kv_pool: [B, N, Dh]; topk: [B, T, K] int32 (-1 = none);
    window: [B, S, Dh]; window_start: [B]; q_pos: [B, T]; sinks: [H] f32.
    out_init: optional [B, T, H, Dh] buffer the output is written into in place (tests poison it with NaN to
    prove every element is written; unused when the keys are split). splits: programs per (head tile, row)
    over the keys (default ``key_splits``); with more than one, each writes its partial softmax state
    (f32 numerator, running max, denominator) and ``_combine`` joins them and the sink.
    Returns o: [B, T, H, Dh] in q's dtype.
    """
    batch, num_q, num_heads, head_dim = q.shape
    head_tile = min(32, num_heads) if head_tile is None else head_tile
    lanes = lanes_for(head_tile)
    defaults = default_tiling(lanes)
    key_tile = defaults[0] if key_tile is None else key_tile
    num_warps = defaults[1] if num_warps is None else num_warps
    num_stages = defaults[2] if num_stages is None else num_stages
    num_comp = topk.shape[-1]
    num_comp_tiles = pl.cdiv(num_comp, key_tile)
    padded = max(num_comp_tiles, 1) * key_tile   # at least one (unused) tile so the ref is never empty
    topk = jnp.pad(topk.astype(jnp.int32), ((0, 0), (0, 0), (0, padded - num_comp)), constant_values=-1)
    if kv_pool.shape[1] == 0:
        kv_pool = jnp.zeros((batch, 1, head_dim), q.dtype)
    if window.shape[1] == 0:
        window = jnp.zeros((batch, 1, head_dim), q.dtype)
    q_pos = q_pos.astype(jnp.int32)
    first_row = q_pos - window_start.astype(jnp.int32)[:, None] - (window_size - 1)
    key_tiles = num_comp_tiles + pl.cdiv(window_size, key_tile)
    splits = key_splits(batch * num_q, key_tiles) if splits is None else max(1, min(splits, key_tiles))
    kernel = functools.partial(
        _kernel, num_heads=num_heads, head_tile=head_tile, lanes=lanes, window_size=window_size,
        key_tile=key_tile, num_comp_tiles=num_comp_tiles, scale_log2=scale * LOG2E, splits=splits)

    # Grid (head tile · splits + split, row, sequence): CUDA schedules the first axis fastest, so the programs
    # of one row (its head tiles and key splits) run side by side and share its q and gathered keys in L2.
    row_scalar = pl.BlockSpec((None, None), lambda j, t, b: (b, t))
    per_seq = lambda n: pl.BlockSpec((None, n, head_dim), lambda j, t, b: (b, 0, 0))
    heads_of_row = pl.BlockSpec((None, None, num_heads, head_dim), lambda j, t, b: (b, t, 0, 0))
    in_specs = [
        row_scalar, row_scalar, heads_of_row, per_seq(kv_pool.shape[1]),
        pl.BlockSpec((None, None, padded), lambda j, t, b: (b, t, 0)),
        per_seq(window.shape[1]),
        pl.BlockSpec((num_heads,), lambda j, t, b: (0,)),
    ]
    operands = [q_pos, first_row, q, kv_pool, topk, window, sinks.astype(jnp.float32)]
    grid = (pl.cdiv(num_heads, head_tile) * splits, num_q, batch)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        part = lambda *shape: pl.BlockSpec((None, None, None, *shape),
                                           lambda j, t, b: (b, t, j % splits) + (0,) * len(shape))
        acc, m, den = pl.pallas_call(
            kernel, grid=grid, in_specs=in_specs,
            out_specs=[part(num_heads, head_dim), part(num_heads), part(num_heads)],
            out_shape=[jax.ShapeDtypeStruct((batch, num_q, splits, num_heads, head_dim), jnp.float32),
                       jax.ShapeDtypeStruct((batch, num_q, splits, num_heads), jnp.float32),
                       jax.ShapeDtypeStruct((batch, num_q, splits, num_heads), jnp.float32)],
            compiler_params=params, interpret=interpret, name="sparse_attention_split")(*operands)
        # materialised: left to fuse, XLA recomputed the join inside the consumer's GEMV (each output column
        # re-reading every split's numerator)
        return lax.optimization_barrier(_combine(acc, m, den, sinks).astype(q.dtype))
    aliases = {}
    if out_init is not None:
        in_specs.append(heads_of_row)
        operands.append(out_init.astype(q.dtype))
        aliases = {len(operands) - 1: 0}
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=heads_of_row,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        input_output_aliases=aliases,
        compiler_params=params,
        interpret=interpret,
        name="sparse_attention",
    )(*operands)


def _combine(acc, m, den, sinks):
    """The splits' softmax states joined, then the sink, as ``_finish`` does for one split in the kernel:
    acc f32 [B, T, S, H, Dh], m, den f32 [B, T, S, H] (log2 units; a split without a valid key has den = 0) ->
    o f32 [B, T, H, Dh]."""
    sink = sinks.astype(jnp.float32) * LOG2E                                    # [H]
    m_final = jnp.maximum(jnp.max(m, axis=2), sink)                             # [B, T, H]
    rescale = jnp.exp2(m - m_final[:, :, None])                                 # [B, T, S, H]
    numerator = jnp.sum(acc * rescale[..., None], axis=2)
    den_total = jnp.sum(den * rescale, axis=2)
    out = numerator / (den_total + jnp.exp2(sink - m_final))[..., None]
    return jnp.where((den_total > 0)[..., None], out, 0.0)
