"""Pallas (Triton lowering) kernel: indexer scores fused with an exact top-k (MODEL.md §B.8).

Why this design. A streaming exact top-512 needs a sort or a per-row heap, which Triton-Pallas cannot express
(no sort, no large dynamic gathers, no shared-memory control). Instead the kernel finds, per query row, a
threshold L no larger than the K-th best score, and writes out only the keys at or above it; one small
``lax.top_k`` over those candidates finishes. The score GEMM is recomputed once per pass (it is the cheap part:
~11 ms for the 2-layer 300K case at the bf16 rate, the memory traffic is ~0.3 GB per pass):

1. **maxima** (mode 0): per group of G consecutive keys (G = B_c for the candidate source, else 8), the
   maximum score -> [rows, N/G] (1/G of the score matrix). XLA takes L = the K-th largest group maximum
   (−∞ when fewer than K groups are visible). The candidate source's block scores are these maxima (G = B_c),
   so its candidate blocks (level 1) come from the same pass.
2. **emit** (mode 1): every key with score > L, and the first (lowest-index) keys with score = L up to the
   split's quota, written as (score, index) in ascending key order from the split's first slot; slots within
   a tile come from an exclusive prefix sum done as an MMA with a triangular 0/1 matrix (exact in f32).

Each split's first slot and tie quota come from the maxima, with no counting pass over the keys. For split s
let a_s = its groups with maximum > L and e_s = those with maximum = L (E_<s: the e of the splits before s).
A group with maximum = L holds at least one key = L, so at least E_<s ties precede split s and it needs at
most q_s = max(0, K − E_<s) of its own. Its keys ≥ L lie in its a_s + e_s groups, those in the e_s groups all
= L, so split s writes at most r_s = min(G·a_s + min(q_s, G·e_s), keys of the split) slots; its first slot is
Σ_<s r.
Since Σ a ≤ K − 1 and the e_s of the splits with q_s > 0 sum to < K plus the last one's, Σ r ≤ 2G(K−1) + K
(and ≤ the keys): the buffer never overflows. Slots are in key order, and the final ``lax.top_k`` prefers the
lower slot: among equal scores the lower entry index wins, the op's tie rule and the XLA path's. Both passes
run one compiled kernel (the mode is a runtime input), so a key's score is bitwise the same in both and the
threshold test is exact.

Scores per key tile: for each head h (a loop), ReLU(q_h · kᵀ) on the MMA with f32 accumulation, times
w_h·d_I^(−1/2), summed in f32; q and keys in bf16 (fp4-rounded values are exact in bf16) or e4m3 with a
power-of-two scale per (row, head) and per key folded back exactly (``score_dtype="float8_e4m3fn"``).
Grid (row block, key split, sequence); a program walks only the key tiles its rows can see. The group maxima
scale with the cache (rows × N/G), so ``ops`` runs long segments in launches of rows sized to a workspace
budget (``tiling.launch_rows``; the planner's "fused" path uses the same function).

Cost (docs/BENCHMARKS.md): 2 score passes, each the full score GEMM over the visible keys; the K-th-maximum
``lax.top_k`` over N/G maxima, the splits' slots and the final ``lax.top_k`` over the candidates run in XLA
between and after the passes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.indexer.tiling import tiling

MAXIMA, EMIT = 0, 1


def _kernel(mode_ref, nvis_ref, thresh_ref, quota_ref, offset_ref, q_ref, w_ref, keys_ref, kscale_ref,
            kept_ref, maxima_ref, cand_s_ref, cand_i_ref, n_gt_ref, n_eq_ref, *, heads: int, key_tile: int,
            group: int, tiles_per_split: int, capacity: int, block_size: int, masked: bool):
    """Refs (one program = BR rows × one key split of one sequence):
    mode [1] int32; nvis, thresh [BR] (int32, f32); quota, offset [BR] int32 (this split's tie quota and first
    candidate slot); q [Hp, BR, d]; w [Hp, BR] f32 (× d^-1/2 × q scale); keys [Np, d]; kscale [Np] f32;
    kept [BR, nb] int8 (candidate mask of reindex layers; unused otherwise).
    Outputs: maxima [BR, groups of this split] f32; cand_s, cand_i [BR, C + 1] (slot C: spare); n_gt, n_eq
    [BR] int32."""
    mode = mode_ref[0]
    rows_in_block = nvis_ref.shape[0]
    split = pl.program_id(1)
    nvis = nvis_ref[...]
    thresh = thresh_ref[...]
    quota = quota_ref[...]
    offset = offset_ref[...]
    rows = jnp.arange(rows_in_block)
    iota = jnp.arange(key_tile)
    strictly_before = (iota[:, None] < iota[None, :]).astype(jnp.bfloat16)   # [KT, KT]: exclusive prefix
    groups_per_tile = key_tile // group
    first_tile = split * tiles_per_split
    seen = jnp.maximum(jnp.max(nvis) - first_tile * key_tile, 0)              # keys of this split in range
    live_tiles = jnp.clip((seen + key_tile - 1) // key_tile, 0, tiles_per_split)
    write_maxima = jnp.broadcast_to(mode == MAXIMA, (rows_in_block,))

    def tile_scores(tile):
        key0 = (first_tile + tile) * key_tile
        keys = keys_ref[pl.ds(key0, key_tile), :]

        def head(h, acc):
            s = lax.dot_general(q_ref[h], keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            return acc + jnp.maximum(s, 0.0) * w_ref[h][:, None]

        acc = lax.fori_loop(0, heads, head, jnp.zeros((rows_in_block, key_tile), jnp.float32))
        acc = acc * kscale_ref[pl.ds(key0, key_tile)][None, :]
        col = key0 + iota
        ok = col[None, :] < nvis[:, None]
        if masked:
            blk = jnp.minimum(col // block_size, kept_ref.shape[1] - 1)
            kept = plgpu.load(kept_ref.at[rows[:, None], blk[None, :]])
            ok = ok & (kept != 0)
        return jnp.where(ok, acc, -jnp.inf), ok, col

    def store_maxima(tile, s):
        for g in range(groups_per_tile):
            in_group = (iota // group == g)[None, :]
            m = jnp.max(jnp.where(in_group, s, -jnp.inf), axis=1)
            plgpu.store(maxima_ref.at[:, tile * groups_per_tile + g], m, mask=write_maxima)

    def prefix(flags):
        """Exclusive prefix count along keys (exact: 0/1 products, f32 sums ≤ KT)."""
        return jnp.dot(flags.astype(jnp.bfloat16), strictly_before,
                       preferred_element_type=jnp.float32).astype(jnp.int32)

    def live(tile, carry):
        n_gt, n_eq = carry
        s, ok, col = tile_scores(tile)
        store_maxima(tile, s)
        gt = ok & (s > thresh[:, None])
        eq = ok & (s == thresh[:, None])
        eq = eq & (n_eq[:, None] + prefix(eq) < quota[:, None])     # ties: lowest index first, up to the quota
        take = gt | eq
        slot = offset[:, None] + n_gt[:, None] + n_eq[:, None] + prefix(take)
        emit = take & (slot < capacity) & (mode == EMIT)
        # Lanes that do not emit point at the spare slot `capacity` (never read): an emulated masked scatter
        # (interpret mode) may still write them, and must not hit a slot another lane fills.
        idx = (rows[:, None], jnp.where(emit, slot, capacity))
        plgpu.store(cand_s_ref.at[idx], s, mask=emit)
        plgpu.store(cand_i_ref.at[idx], jnp.broadcast_to(col[None, :], s.shape), mask=emit)
        return n_gt + jnp.sum(gt.astype(jnp.int32), axis=1), n_eq + jnp.sum(eq.astype(jnp.int32), axis=1)

    def dead(tile, carry):
        store_maxima(tile, jnp.full((rows_in_block, key_tile), -jnp.inf, jnp.float32))
        return carry

    zeros = jnp.zeros((rows_in_block,), jnp.int32)
    n_gt, n_eq = lax.fori_loop(0, live_tiles, live, (zeros, zeros))
    lax.fori_loop(live_tiles, tiles_per_split, dead, 0)
    n_gt_ref[...] = n_gt
    n_eq_ref[...] = n_eq


@functools.partial(jax.jit, static_argnames=(
    "ratio", "k", "keep_blocks", "block_size", "score_dtype", "block_rows", "key_tile", "group", "splits",
    "num_warps", "num_stages", "interpret"))
def index_topk_pallas(q, w, keys, positions, kept_blocks=None, *, ratio: int, k: int, keep_blocks: int = 0,
                      block_size: int = 1, score_dtype: str = "bfloat16", block_rows: int | None = None,
                      key_tile: int | None = None, group: int | None = None, splits: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None, interpret: bool = False):
    """The op's contract (``ops.index_topk``) on the kernel; tiling arguments default as in ``tiling``."""
    b, t, heads, d = q.shape
    n = keys.shape[1]
    kk = min(k, n)
    n_blocks = -(-n // block_size)
    if kk == 0:
        kept = jnp.zeros((b, t, n_blocks), bool) if keep_blocks else None
        return jnp.zeros((b, t, 0), jnp.int32), kept
    tl = tiling(b, t, n, kk, keep_blocks=keep_blocks, block_size=block_size, block_rows=block_rows,
                key_tile=key_tile, group=group, splits=splits, num_warps=num_warps, num_stages=num_stages)
    br, kt, g, s_count = tl["block_rows"], tl["key_tile"], tl["group"], tl["splits"]
    t_pad = -(-t // br) * br
    tiles = -(-n // kt)
    per_split = -(-tiles // s_count)
    n_pad = s_count * per_split * kt
    capacity = tl["capacity"]

    qs, ws, ks, kscale = _score_operands(q, w, keys, score_dtype)
    pad_rows = lambda x: jnp.pad(x, [(0, 0), (0, t_pad - t)] + [(0, 0)] * (x.ndim - 2))
    qs = jnp.swapaxes(pad_rows(qs), 1, 2)                         # [B, Hp, T_pad, d]
    ws = jnp.swapaxes(pad_rows(ws), 1, 2)                         # [B, Hp, T_pad]
    ks = jnp.pad(ks, ((0, 0), (0, n_pad - n), (0, 0)))
    kscale = jnp.pad(kscale, ((0, 0), (0, n_pad - n)), constant_values=1.0)
    nvis = jnp.clip((positions.astype(jnp.int32) + 1) // ratio, 0, n)
    nvis = pad_rows(nvis)                                         # padding rows see nothing
    masked = kept_blocks is not None
    kept = pad_rows(kept_blocks.astype(jnp.int8)) if masked else jnp.zeros((b, t_pad, 1), jnp.int8)

    kernel = functools.partial(_kernel, heads=qs.shape[1], key_tile=kt, group=g, tiles_per_split=per_split,
                               capacity=capacity, block_size=block_size, masked=masked)
    hp = qs.shape[1]
    row_vec = pl.BlockSpec((None, br), lambda i, s, bb: (bb, i))
    split_vec = pl.BlockSpec((None, None, br), lambda i, s, bb: (bb, s, i))
    in_specs = [
        pl.BlockSpec((1,), lambda i, s, bb: (0,)), row_vec, row_vec, split_vec, split_vec,
        pl.BlockSpec((None, hp, br, d), lambda i, s, bb: (bb, 0, i, 0)),
        pl.BlockSpec((None, hp, br), lambda i, s, bb: (bb, 0, i)),
        pl.BlockSpec((None, n_pad, d), lambda i, s, bb: (bb, 0, 0)),
        pl.BlockSpec((None, n_pad), lambda i, s, bb: (bb, 0)),
        pl.BlockSpec((None, br, kept.shape[2]), lambda i, s, bb: (bb, i, 0)),
    ]
    groups_split = per_split * kt // g
    cand = pl.BlockSpec((None, br, capacity + 1), lambda i, s, bb: (bb, i, 0))
    out_specs = [pl.BlockSpec((None, br, groups_split), lambda i, s, bb: (bb, i, s)), cand, cand,
                 split_vec, split_vec]
    out_shape = [jax.ShapeDtypeStruct((b, t_pad, s_count * groups_split), jnp.float32),
                 jax.ShapeDtypeStruct((b, t_pad, capacity + 1), jnp.float32),
                 jax.ShapeDtypeStruct((b, t_pad, capacity + 1), jnp.int32),
                 jax.ShapeDtypeStruct((b, s_count, t_pad), jnp.int32),
                 jax.ShapeDtypeStruct((b, s_count, t_pad), jnp.int32)]
    call = pl.pallas_call(
        kernel, grid=(t_pad // br, s_count, b), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tl["num_warps"], num_stages=tl["num_stages"]),
        interpret=interpret, name="index_topk")

    zeros_split = jnp.zeros((b, s_count, t_pad), jnp.int32)
    n_groups = -(-n // g)
    split_keys = per_split * kt

    def after_maxima(outs, state):
        """L = the K-th largest group maximum (≤ the K-th best score; −∞ when fewer than K groups), and per
        split its tie quota and first slot (the module docstring's q_s and Σ_<s r)."""
        maxima = outs[0][:, :, :n_groups]
        if n_groups >= kk:
            thresh = lax.top_k(maxima, kk)[0][..., kk - 1]
        else:
            thresh = jnp.full((b, t_pad), -jnp.inf, jnp.float32)
        thresh = jnp.where(jnp.arange(t_pad) < t, thresh, jnp.inf)
        per_split = jnp.swapaxes(outs[0].reshape(b, t_pad, s_count, -1), 1, 2)        # [B, S, T_pad, groups]
        above = jnp.sum(per_split > thresh[:, None, :, None], axis=-1, dtype=jnp.int32)
        at = jnp.sum(per_split == thresh[:, None, :, None], axis=-1, dtype=jnp.int32)
        quota = jnp.maximum(kk - (jnp.cumsum(at, axis=1) - at), 0)
        room = jnp.minimum(g * above + jnp.minimum(quota, g * at), split_keys)
        return (thresh, quota, jnp.cumsum(room, axis=1) - room, maxima, *state[4:])

    def after_emit(outs, state):
        return (*state[:4], *outs[1:])

    def one_pass(mode, state):
        outs = call(jnp.full((1,), mode, jnp.int32), nvis, *state[:3], qs, ws, ks, kscale, kept)
        return lax.cond(mode == MAXIMA, after_maxima, after_emit, outs, state)

    # One compiled kernel runs both passes (a key's score is bitwise the same in both).
    state = (jnp.zeros((b, t_pad), jnp.float32), zeros_split, zeros_split,
             jnp.zeros((b, t_pad, n_groups), jnp.float32),
             jnp.zeros((b, t_pad, capacity + 1), jnp.float32), jnp.zeros((b, t_pad, capacity + 1), jnp.int32),
             zeros_split, zeros_split)
    _, _, offset, maxima, cand_s, cand_i, n_gt, n_eq = lax.fori_loop(MAXIMA, EMIT + 1, one_pass, state)
    new_kept = None
    if keep_blocks:
        from pallas_kernels.indexer.xla import candidate_mask
        new_kept = candidate_mask(maxima[:, :t], positions, ratio=ratio, block_size=block_size,
                                  keep_blocks=keep_blocks)
    cand_s, cand_i = cand_s[:, :t], cand_i[:, :t]
    filled = _written(offset[..., :t], (n_gt + n_eq)[..., :t], capacity)
    best, slot = lax.top_k(jnp.where(filled, cand_s, -jnp.inf), kk)
    picks = jnp.take_along_axis(cand_i, slot, axis=-1)
    return jnp.where(best > -jnp.inf, picks, -1).astype(jnp.int32), new_kept


def _written(offset, taken, capacity: int):
    """bool [B, T, capacity + 1]: the candidate slots the emit pass wrote. offset, taken [B, S, T]: per split,
    its first slot and the keys it wrote (runs of consecutive slots, in split order)."""
    b, _, t = offset.shape
    bi, ti = jnp.arange(b)[:, None, None], jnp.arange(t)[None, None, :]
    edges = jnp.zeros((b, t, capacity + 2), jnp.int32)              # +1 where a run starts, -1 after it
    edges = edges.at[bi, ti, offset].add(1).at[bi, ti, offset + taken].add(-1)
    return jnp.cumsum(edges, axis=-1)[..., :capacity + 1] > 0


def _score_operands(q, w, keys, score_dtype: str):
    """(q', w', keys', key scale) for the MMA: heads padded to a power of two (weight 0), w × d^-1/2.

    bf16: q, keys cast (exact for fp4-rounded values); scales 1. e4m3: q per (row, head) and keys per key
    multiplied by a power of two that puts their largest magnitude in [64, 128) before the cast; the inverse
    powers go into w and the key scale (exact: multiplications by powers of two)."""
    b, t, heads, d = q.shape
    hp = 1 << max(0, (heads - 1).bit_length())
    q = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, 0), (0, hp - heads), (0, 0)))
    w = jnp.pad(w.astype(jnp.float32) * d**-0.5, ((0, 0), (0, 0), (0, hp - heads)))
    keys = keys.astype(jnp.float32)
    if score_dtype == "bfloat16":
        return q.astype(jnp.bfloat16), w, keys.astype(jnp.bfloat16), jnp.ones(keys.shape[:2], jnp.float32)
    dtype = jnp.dtype(score_dtype)
    eq = jnp.frexp(jnp.max(jnp.abs(q), axis=-1))[1] - 7            # [B,T,Hp]
    ek = jnp.frexp(jnp.max(jnp.abs(keys), axis=-1))[1] - 7          # [B,N]
    q8 = jnp.ldexp(q, -eq[..., None]).astype(dtype)
    k8 = jnp.ldexp(keys, -ek[..., None]).astype(dtype)
    return q8, jnp.ldexp(w, eq), k8, jnp.ldexp(jnp.ones(ek.shape, jnp.float32), ek)


def fp8_exact(q, keys) -> jnp.ndarray:
    """True when the e4m3 operands of ``_score_operands`` hold q and keys exactly (fp4-rounded values whose
    blocks' scales are within e4m3's range of each other)."""
    w = jnp.zeros(q.shape[:3], jnp.float32)
    q8, _, k8, kscale = _score_operands(q, w, keys, "float8_e4m3fn")
    hp = q8.shape[2]
    qp = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, 0), (0, hp - q.shape[2]), (0, 0)))
    eq = jnp.frexp(jnp.max(jnp.abs(qp), axis=-1))[1] - 7
    q_back = jnp.ldexp(q8.astype(jnp.float32), eq[..., None])
    k_back = k8.astype(jnp.float32) * kscale[..., None]
    return jnp.all(q_back == qp) & jnp.all(k_back == keys.astype(jnp.float32))
