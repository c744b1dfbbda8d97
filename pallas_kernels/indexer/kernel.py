"""Pallas (Triton lowering) kernels: indexer scores fused with an exact top-k (MODEL.md §B.8).

Why this design. A streaming exact top-512 needs a sort or a per-row heap, which Triton-Pallas cannot express
(no sort, no shared-memory control). Instead one pass over the keys keeps, per query
row, only the maximum score of each group of G consecutive keys (1/G of the score matrix), and the K best
groups are rescored:

1. **maxima** (``_maxima_kernel``, the only pass over all keys): per key tile, the scores on the MMA and their
   maximum per group of G keys (G = B_c for the candidate source, so its block scores and level-1 candidate
   blocks come from the same pass; else 8) -> [rows, N/G] f32.
2. **groups** (``best_groups``): the K groups with the largest maxima (equal maxima: the lower group first), in
   key order; in two levels through super-groups of groups when the row is long.
3. **rescore** (``_rescore_kernel``): the K·G keys of those groups gathered per row and scored again -> [rows,
   K·G] f32; the top K of them (equal scores: the lower slot, and slots are in key order) are the picks.

A key buffer of at most K·G keys (a cache sized for a short context) would rescore every key: there G = 1
(``tiling``; static, by the buffer's size), the pass keeps every key's score and the top K of those are the picks
(no group selection, no rescore); the candidate source's block maxima are then taken from those scores.

Selections of K run in ``_select_kernel`` (one row of up to SELECT_MAX entries in registers, the K-th value
found bit by bit with up to 32 count reductions, stopping once exactly K entries lie at or above the bits found;
several times faster than ``lax.top_k``, which sorts: measured, see docs/BENCHMARKS.md, sections "Indexer: one
score pass, the best groups rescored" and "Decode attention split over keys; select kernel that stops early");
``top_k_indices`` selects longer rows piece by piece. Both pick ``lax.top_k``'s entries.

Why the K best groups hold the exact top-K (with the op's tie rule: among equal scores the lower key index).
Let L be the K-th largest group maximum. A key with score > L lies in a group with maximum > L: all such groups
(< K of them) are taken. A key x = L that is needed lies in a taken group: if its group has maximum > L it is
taken; if its group's maximum is L and the group was not taken, the K groups taken before it at maximum ≥ L
include every group of maximum > L and K − #(groups > L) groups of maximum L with lower index, each holding a
key = L below x, so at least K − #(keys > L) tied keys precede x and x is not needed.

Both kernels form a key's score from exact products (bf16, or e4m3 with power-of-two scales) summed in f32, so
where that sum is exact (the fp4 grid's values at moderate head counts, the tests' cases) the rescored scores
equal the maxima pass's bitwise; otherwise the two summation orders may differ in the last bits, and so may the
selection at a K-th score tied within that rounding, as between the op's two implementations.

Scores per key tile: for each head h (a loop), ReLU(q_h · kᵀ) on the MMA with f32 accumulation, times
w_h·d_I^(−1/2), summed in f32; q and keys in bf16 (fp4-rounded values are exact in bf16) or e4m3 with a
power-of-two scale per (row, head) and per key folded back exactly (``score_dtype="float8_e4m3fn"``, maxima
pass only; the rescore is bf16). Maxima grid (row block, key split, sequence); a program walks only the key
tiles its rows can see. Launches of few rows (decode: ``tiling.ROW_PROGRAM_MAX``) run ``_row_maxima_kernel``
instead: one program per (row, key split), the row's heads the MMA's rows (a 16-row block would be mostly
padding), bf16, reading the key cache in place (masked loads, no padded copy). The group maxima scale with
the cache (rows × N/G), so ``ops`` runs long segments in launches of rows sized to a workspace budget
(``tiling.launch_rows``; the planner's "fused" path uses the same function).

Cost: one score pass over the visible keys (the bulk of the op at long context); the group selection over N/G
maxima; the rescore of K·G keys per row (2·H·d·K·G FLOPs, the keys gathered from HBM) and a selection over K·G
entries. Measured rates: docs/BENCHMARKS.md, sections "Indexer: one score pass, the best groups rescored" and
"Indexer score pass on Mosaic GPU".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.indexer import mosaic
from pallas_kernels.indexer.tiling import RESCORE_TILE, SELECT_BITS, SELECT_MAX, SUPER_GROUPS, tiling
from pallas_kernels.indexer.xla import block_maxima, candidate_mask

# The maxima pass of prefill launches on sm_90: "mosaic" (``mosaic.py``, warp-specialised, wherever
# ``mosaic.supported``; elsewhere the Triton pass) or "triton" (``_maxima_kernel``, every launch). The Mosaic pass
# is the faster, with the same picks (measured: see docs/BENCHMARKS.md, section "Indexer score pass on Mosaic
# GPU"). Read when the op is traced: set it before the first call (the jitted op keeps what it traced).
SCORE_PASS = "mosaic"


def _maxima_kernel(nvis_ref, q_ref, w_ref, keys_ref, kscale_ref, kept_ref, maxima_ref, *, heads: int,
                   key_tile: int, group: int, tiles_per_split: int, block_size: int, masked: bool):
    """One program = BR rows × one key split of one sequence. Refs: nvis [BR] int32 (visible keys per row);
    q [Hp, BR, d]; w [Hp, BR] f32 (× d^-1/2 × q scale); keys [Np, d]; kscale [Np] f32; kept [BR, nb] int8
    (candidate mask of reindex layers; unused otherwise). Output: maxima [BR, groups of this split] f32."""
    rows_in_block = nvis_ref.shape[0]
    nvis = nvis_ref[...]
    rows = jnp.arange(rows_in_block)
    iota = jnp.arange(key_tile)
    groups_per_tile = key_tile // group
    first_tile = pl.program_id(1) * tiles_per_split
    seen = jnp.maximum(jnp.max(nvis) - first_tile * key_tile, 0)              # keys of this split in range
    live_tiles = jnp.clip((seen + key_tile - 1) // key_tile, 0, tiles_per_split)

    def store(tile, m):
        maxima_ref[:, pl.ds(pl.multiple_of(tile * groups_per_tile, groups_per_tile), groups_per_tile)] = m

    def live(tile, carry):
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
            ok = ok & (plgpu.load(kept_ref.at[rows[:, None], blk[None, :]]) != 0)
        s = jnp.where(ok, acc, -jnp.inf)
        store(tile, _group_max(s, group))
        return carry

    def dead(tile, carry):
        store(tile, jnp.full((rows_in_block, groups_per_tile), -jnp.inf, jnp.float32))
        return carry

    lax.fori_loop(0, live_tiles, live, 0)
    lax.fori_loop(live_tiles, tiles_per_split, dead, 0)


def _row_maxima_kernel(nvis_ref, q_ref, w_ref, keys_ref, kept_ref, maxima_ref, *, key_tile: int, group: int,
                       tiles_per_split: int, block_size: int, masked: bool):
    """The maxima pass for few rows (decode): one program = one query row × one key split, the row's heads
    the MMA's rows, so no MMA row is padding. Refs: nvis [1] int32; q [Hp, d] bf16 (Hp ≥ 16); w [Hp] f32
    (× d^-1/2); keys [N, d] bf16, the cache as it is (loads masked past the row's visible keys); kept [1, nb]
    int8. Output: maxima [groups of this split] f32."""
    nvis = nvis_ref[0]
    iota = jnp.arange(key_tile)
    groups_per_tile = key_tile // group
    first_tile = pl.program_id(1) * tiles_per_split
    seen = jnp.maximum(nvis - first_tile * key_tile, 0)
    live_tiles = jnp.clip((seen + key_tile - 1) // key_tile, 0, tiles_per_split)

    def store(tile, m):
        maxima_ref[pl.ds(pl.multiple_of(tile * groups_per_tile, groups_per_tile), groups_per_tile)] = m

    def live(tile, carry):
        key0 = (first_tile + tile) * key_tile
        col = key0 + iota
        ok = col < nvis
        keys = plgpu.load(keys_ref.at[pl.ds(key0, key_tile), :], mask=ok[:, None], other=0.0)
        score = _head_sum(q_ref[...], keys, w_ref[...])                                       # [key_tile]
        if masked:
            ok = ok & _kept(kept_ref, col, block_size)
        score = jnp.where(ok, score, -jnp.inf)
        store(tile, _group_max(score, group))
        return carry

    def dead(tile, carry):
        store(tile, jnp.full((groups_per_tile,), -jnp.inf, jnp.float32))
        return carry

    lax.fori_loop(0, live_tiles, live, 0)
    lax.fori_loop(live_tiles, tiles_per_split, dead, 0)


def _rescore_kernel(nvis_ref, cand_ref, q_ref, w_ref, keys_ref, kept_ref, out_ref, *, block_size: int,
                    masked: bool):
    """One program = one query row × RESCORE_TILE candidates. Refs: nvis [1] int32; cand [CT] int32 (key
    indices); q [Hp, d] bf16; w [Hp] f32 (× d^-1/2); keys [Np, d] bf16; kept [1, nb] int8. Output: scores
    [CT] f32, −∞ for keys not visible or masked."""
    cand = cand_ref[...]
    d = keys_ref.shape[1]
    row = jnp.minimum(cand, keys_ref.shape[0] - 1)        # keys past N (a last group's, padding): read key N−1
    keys = plgpu.load(keys_ref.at[row[:, None], jnp.arange(d)[None, :]])                # [CT, d] gathered
    score = _head_sum(q_ref[...], keys, w_ref[...])                                      # [CT]
    ok = cand < nvis_ref[0]
    if masked:
        ok = ok & _kept(kept_ref, cand, block_size)
    out_ref[...] = jnp.where(ok, score, -jnp.inf)


def _head_sum(q, keys, w):
    """One row's scores Σ_h w_h · ReLU(q_h · k), the heads as the MMA's rows: q [Hp, d], keys [C, d], w [Hp]
    f32 -> [C] f32 (f32 accumulation)."""
    s = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return jnp.sum(jnp.maximum(s, 0.0) * w[:, None], axis=0)


def _group_max(s, group: int):
    """The maximum of each group of ``group`` consecutive keys (the last axis): [..., C] -> [..., C / group]
    (group 1: the scores themselves)."""
    if group == 1:
        return s
    return jnp.max(s.reshape(*s.shape[:-1], s.shape[-1] // group, group), axis=-1)


def _kept(kept_ref, key, block_size: int):
    """Whether each key's candidate block is kept: kept [1, nb] int8, key [C] int32 -> bool [C]."""
    blk = jnp.minimum(key // block_size, kept_ref.shape[1] - 1)
    return plgpu.load(kept_ref.at[0, blk]) != 0


def _select_kernel(v_ref, out_ref, *, k: int, entries: int, bits: int):
    """One program = one row. v [M] f32 (M a power of two ≥ entries); out [K + 1] int32: the indices of the K
    largest of the first ``entries`` values in ascending order (slot K: spare, never read).

    The K-th largest value's bits are found ``bits`` at a time on an order-preserving int32 key of the floats
    (no sort): the largest t with #(key ≥ t) ≥ K, from the top bits down, 2^bits − 1 counts a step. The walk
    stops early once #(key ≥ t) = K exactly (t with the undecided bits zero): those K are the answer. Every
    entry above t is taken, and of those equal to t the lowest-indexed ones, as many as K still needs; slots
    by exclusive prefix sums."""
    m = v_ref.shape[0]
    iota = jnp.arange(m, dtype=jnp.int32)
    raw = lax.bitcast_convert_type(v_ref[...], jnp.int32)
    key = jnp.where(raw < 0, raw ^ 0x7FFFFFFF, raw)             # float order (−∞ low, −0 just below +0)
    key = jnp.where(iota < entries, key, jnp.int32(-2**31))      # padding: below every float
    kth = _kth_key(key, k, bits)
    above = key > kth
    tied = (key == kth).astype(jnp.int32)
    take = above | ((tied == 1) & (jnp.cumsum(tied) - tied < k - jnp.sum(above.astype(jnp.int32))))
    taken = take.astype(jnp.int32)
    slot = jnp.where(take, jnp.cumsum(taken) - taken, k)
    plgpu.store(out_ref.at[slot], iota, mask=take)


def _kth_key(key, k: int, bits: int):
    """The largest int32 t with #(key ≥ t) ≥ k, or a smaller t with #(key ≥ t) = k exactly (the same picks).

    Works on u = t ^ sign (unsigned order as int32 bit patterns), ``bits`` bits a step from the top; a step
    tries the 2^bits − 1 nonzero digits at once and keeps the largest whose count reaches k."""
    sign = jnp.int32(-2**31)

    def count(u):
        return jnp.sum((key >= (u ^ sign)).astype(jnp.int32))

    def step(carry):
        shift, base, have = carry
        prefix = base
        for digit in range(1, 1 << bits):          # counts fall as the digit grows: the last that fits wins
            trial = base | (jnp.int32(digit) << shift)
            n = count(trial)
            fits = n >= k
            prefix, have = jnp.where(fits, trial, prefix), jnp.where(fits, n, have)
        return shift - bits, prefix, have

    def going(carry):
        shift, _, have = carry
        return (shift >= 0) & (have != k)

    start = (jnp.int32(32 - bits), jnp.int32(0), jnp.int32(key.shape[0]))
    _, prefix, _ = lax.while_loop(going, step, start)
    return prefix ^ sign


def top_k_indices(v, k: int, *, interpret: bool = False, max_entries: int = SELECT_MAX,
                  bits: int = SELECT_BITS):
    """The indices of the K largest of each row, in ascending order: v f32 [..., M] -> int32 [..., K].
    ``lax.top_k``'s picks (the floats' total order, equal values: the lower index), without its sort.

    Rows of up to ``max_entries`` are selected in one program (``_select_kernel``). A longer row is cut into
    pieces of max_entries / 2: the K best of each piece, then the K best of their union (in index order). Exact:
    an entry among the row's K best has fewer than K entries before it in (value, then lower index) order, so
    fewer than K in its piece, and it is among its piece's K best."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits (of the K-th value decided a step) must divide 32 and be at most 8, got {bits}")
    *lead, m = v.shape
    piece = max_entries // 2
    if m > max_entries:
        if k > piece // 2:
            return jnp.sort(lax.top_k(v, k)[1], axis=-1)
        pieces = -(-m // piece)
        padded = jnp.pad(v, [(0, 0)] * len(lead) + [(0, pieces * piece - m)], constant_values=-jnp.inf)
        local = top_k_indices(padded.reshape(*lead, pieces, piece), k, interpret=interpret,
                              max_entries=max_entries, bits=bits)                  # [..., pieces, K]
        union = (local + jnp.arange(pieces, dtype=jnp.int32)[:, None] * piece).reshape(*lead, pieces * k)
        best = top_k_indices(jnp.take_along_axis(padded, union, axis=-1), k, interpret=interpret,
                             max_entries=max_entries, bits=bits)
        return jnp.take_along_axis(union, best, axis=-1)
    rows = math.prod(lead)
    mp = 1 << max(4, (m - 1).bit_length())
    flat = jnp.pad(v.reshape(rows, m).astype(jnp.float32), ((0, 0), (0, mp - m)))
    out = pl.pallas_call(
        functools.partial(_select_kernel, k=k, entries=m, bits=bits), grid=(rows,),
        in_specs=[pl.BlockSpec((None, mp), lambda r: (r, 0))],
        out_specs=pl.BlockSpec((None, k + 1), lambda r: (r, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, k + 1), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=4 if mp <= 4096 else 8, num_stages=1),
        interpret=interpret, name="index_select")(flat)
    return out[:, :k].reshape(*lead, k)


@functools.partial(jax.jit, static_argnames=(
    "ratio", "k", "keep_blocks", "block_size", "score_dtype", "block_rows", "key_tile", "group", "splits",
    "num_warps", "num_stages", "interpret"))
def index_topk_pallas(q, w, keys, positions, kept_blocks=None, *, ratio: int, k: int, keep_blocks: int = 0,
                      block_size: int = 1, score_dtype: str = "bfloat16", block_rows: int | None = None,
                      key_tile: int | None = None, group: int | None = None, splits: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None, interpret: bool = False):
    """The op's contract (``ops.index_topk``) on the kernels; tiling arguments default as in ``tiling``."""
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
    n_groups = -(-n // g)

    pad_rows = lambda x: jnp.pad(x, [(0, 0), (0, t_pad - t)] + [(0, 0)] * (x.ndim - 2))
    nvis = pad_rows(jnp.clip((positions.astype(jnp.int32) + 1) // ratio, 0, n))   # padding rows see nothing
    masked = kept_blocks is not None
    kept = pad_rows(kept_blocks.astype(jnp.int8)) if masked else jnp.zeros((b, t_pad, 1), jnp.int8)
    pass_kw = dict(tl=tl, per_split=per_split, block_size=block_size, masked=masked, interpret=interpret)
    if br == 1:
        maxima = _row_maxima(q, w, keys, nvis, kept, **pass_kw)
    else:
        maxima = _maxima(q, w, keys, nvis, kept, score_dtype=score_dtype, n_pad=n_pad, **pass_kw)
    maxima = maxima[:, :t, :n_groups]
    new_kept = None
    if keep_blocks:
        blocks = maxima if g == block_size else block_maxima(maxima, block_size)   # g = 1: every key's score
        new_kept = candidate_mask(blocks, positions, ratio=ratio, block_size=block_size, keep_blocks=keep_blocks)
    if g == 1:  # the pass scored every key (tiling: short rows), so select from its scores directly
        return _picks(maxima, jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), maxima.shape), kk, interpret), new_kept
    chosen = best_groups(maxima, min(kk, n_groups), interpret=interpret)               # [B, T, K_g] key order
    cand = (chosen[..., None] * g + jnp.arange(g, dtype=jnp.int32)).reshape(b, t, -1)  # [B, T, K_g·G]
    scores = _rescore(q, w, keys, nvis[:, :t], kept[:, :t], cand, block_size=block_size, masked=masked,
                      num_warps=tl["num_warps"], interpret=interpret)
    return _picks(scores, cand, kk, interpret), new_kept


def _picks(scores, keys, k: int, interpret: bool):
    """The keys of the K best scores (equal scores: the lower slot; slots are in key order), −1 where the score
    is −∞: scores f32 [B, T, C], keys int32 [B, T, C] -> int32 [B, T, K]."""
    slot = top_k_indices(scores, k, interpret=interpret)
    best = jnp.take_along_axis(scores, slot, axis=-1)
    picks = jnp.take_along_axis(keys, slot, axis=-1)
    return jnp.where(best > -jnp.inf, picks, -1).astype(jnp.int32)


def best_groups(maxima, count: int, per_super: int = SUPER_GROUPS, interpret: bool = False):
    """The ``count`` groups with the largest maxima (equal maxima: the lower index first), in ascending order.
    maxima f32 [B, T, M] -> int32 [B, T, count].

    Two levels when M is large (selecting from all M entries at once was the slow part): the ``count`` best
    super-groups of ``per_super`` consecutive groups, then the
    best ``count`` of their groups. Exact with the tie rule by the module docstring's argument, one level up
    (super-groups hold groups as groups hold keys); both selections (``top_k_indices``) prefer the lower slot,
    and slots are in index order."""
    b, t, m = maxima.shape
    select = functools.partial(top_k_indices, interpret=interpret)
    if m <= 2 * count * per_super or per_super <= 1:
        return select(maxima, count)
    supers = -(-m // per_super)
    padded = jnp.pad(maxima, ((0, 0), (0, 0), (0, supers * per_super - m)), constant_values=-jnp.inf)
    best = jnp.max(padded.reshape(b, t, supers, per_super), axis=-1)
    chosen = select(best, min(count, supers))
    members = (chosen[..., None] * per_super + jnp.arange(per_super, dtype=jnp.int32)).reshape(b, t, -1)
    return jnp.take_along_axis(members, select(jnp.take_along_axis(padded, members, axis=-1), count), axis=-1)


def _maxima(q, w, keys, nvis, kept, *, score_dtype, tl, per_split, n_pad, block_size, masked, interpret):
    """The maxima pass: f32 [B, ≥ T, ≥ ⌈N / G⌉] (−∞ for groups no key of which is visible and kept; the Triton
    pass returns [B, T_pad, n_pad / G], the Mosaic one [B, T, ⌈N / 8⌉])."""
    b, t_pad = nvis.shape
    br, kt, g, s_count = tl["block_rows"], tl["key_tile"], tl["group"], tl["splits"]
    qs, ws, ks, kscale = _score_operands(q, w, keys, score_dtype)
    if SCORE_PASS == "mosaic" and mosaic.supported(group=g, head_dim=qs.shape[-1], heads=qs.shape[2],
                                                   masked=masked and g != block_size, score_dtype=score_dtype,
                                                   interpret=interpret):
        t = q.shape[1]   # per sequence: q' [Hp, T, d], w' [Hp, T], its keys and visible counts
        maxima = jnp.stack([mosaic.maxima(jnp.swapaxes(qs[i], 0, 1), jnp.swapaxes(ws[i], 0, 1), ks[i],
                                          nvis[i, :t]) for i in range(b)])
        if masked:   # a group is one candidate block: its maximum is −∞ when the block is dropped
            maxima = jnp.where(kept[:, :t, :maxima.shape[2]] != 0, maxima, -jnp.inf)
        return maxima
    pad_rows = lambda x: jnp.pad(x, [(0, 0), (0, t_pad - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    qs = jnp.swapaxes(pad_rows(qs), 1, 2)                         # [B, Hp, T_pad, d]
    ws = jnp.swapaxes(pad_rows(ws), 1, 2)                         # [B, Hp, T_pad]
    n = keys.shape[1]
    ks = jnp.pad(ks, ((0, 0), (0, n_pad - n), (0, 0)))
    kscale = jnp.pad(kscale, ((0, 0), (0, n_pad - n)), constant_values=1.0)
    hp, d = qs.shape[1], qs.shape[3]
    kernel = functools.partial(_maxima_kernel, heads=hp, key_tile=kt, group=g, tiles_per_split=per_split,
                               block_size=block_size, masked=masked)
    groups_split = per_split * kt // g
    in_specs = [
        pl.BlockSpec((None, br), lambda i, s, bb: (bb, i)),
        pl.BlockSpec((None, hp, br, d), lambda i, s, bb: (bb, 0, i, 0)),
        pl.BlockSpec((None, hp, br), lambda i, s, bb: (bb, 0, i)),
        pl.BlockSpec((None, n_pad, d), lambda i, s, bb: (bb, 0, 0)),
        pl.BlockSpec((None, n_pad), lambda i, s, bb: (bb, 0)),
        pl.BlockSpec((None, br, kept.shape[2]), lambda i, s, bb: (bb, i, 0)),
    ]
    return pl.pallas_call(
        kernel, grid=(t_pad // br, s_count, b), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, br, groups_split), lambda i, s, bb: (bb, i, s)),
        out_shape=jax.ShapeDtypeStruct((b, t_pad, s_count * groups_split), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=tl["num_warps"], num_stages=tl["num_stages"]),
        interpret=interpret, name="index_maxima")(nvis, qs, ws, ks, kscale, kept)


def _row_maxima(q, w, keys, nvis, kept, *, tl, per_split, block_size, masked, interpret):
    """The maxima pass of few rows (``_row_maxima_kernel``, bf16 operands): f32 [B, T, splits · per_split ·
    key_tile / G]."""
    b, t = nvis.shape
    kt, g, s_count = tl["key_tile"], tl["group"], tl["splits"]
    qs, ws, ks, _ = _score_operands(q, w, keys, "bfloat16")
    qs, ws = _mma_heads(qs, ws)
    hp, d, n = qs.shape[2], qs.shape[3], ks.shape[1]
    kernel = functools.partial(_row_maxima_kernel, key_tile=kt, group=g, tiles_per_split=per_split,
                               block_size=block_size, masked=masked)
    groups_split = per_split * kt // g
    in_specs = [
        pl.BlockSpec((None, 1), lambda i, s, bb: (bb, i)),
        pl.BlockSpec((None, None, hp, d), lambda i, s, bb: (bb, i, 0, 0)),
        pl.BlockSpec((None, None, hp), lambda i, s, bb: (bb, i, 0)),
        pl.BlockSpec((None, n, d), lambda i, s, bb: (bb, 0, 0)),
        pl.BlockSpec((None, 1, kept.shape[2]), lambda i, s, bb: (bb, i, 0)),
    ]
    return pl.pallas_call(
        kernel, grid=(t, s_count, b), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, groups_split), lambda i, s, bb: (bb, i, s)),
        out_shape=jax.ShapeDtypeStruct((b, t, s_count * groups_split), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=tl["num_warps"], num_stages=tl["num_stages"]),
        interpret=interpret, name="index_row_maxima")(nvis, qs, ws, ks, kept)


def _mma_heads(qs, ws):
    """q' [B, T, Hp, d], w' [B, T, Hp] with at least 16 heads (the MMA's rows; padding heads weigh 0)."""
    hp = qs.shape[2]
    if hp >= 16:
        return qs, ws
    return (jnp.pad(qs, ((0, 0), (0, 0), (0, 16 - hp), (0, 0))), jnp.pad(ws, ((0, 0), (0, 0), (0, 16 - hp))))


def _rescore(q, w, keys, nvis, kept, cand, *, block_size, masked, num_warps, interpret):
    """Scores of each row's candidate keys: cand int32 [B, T, C] -> f32 [B, T, C] (−∞: not visible / masked)."""
    b, t, c = cand.shape
    ct = min(RESCORE_TILE, 1 << max(4, (c - 1).bit_length()))
    c_pad = -(-c // ct) * ct
    qs, ws, ks, _ = _score_operands(q, w, keys, "bfloat16")
    qs, ws = _mma_heads(qs, ws)
    hp, d = qs.shape[2], qs.shape[3]
    cand_p = jnp.pad(cand, ((0, 0), (0, 0), (0, c_pad - c)), constant_values=keys.shape[1])   # never visible
    n = ks.shape[1]
    kernel = functools.partial(_rescore_kernel, block_size=block_size, masked=masked)
    in_specs = [
        pl.BlockSpec((None, 1), lambda i, j, bb: (bb, i)),
        pl.BlockSpec((None, None, ct), lambda i, j, bb: (bb, i, j)),
        pl.BlockSpec((None, None, hp, d), lambda i, j, bb: (bb, i, 0, 0)),
        pl.BlockSpec((None, None, hp), lambda i, j, bb: (bb, i, 0)),
        pl.BlockSpec((None, n, d), lambda i, j, bb: (bb, 0, 0)),
        pl.BlockSpec((None, 1, kept.shape[2]), lambda i, j, bb: (bb, i, 0)),
    ]
    out = pl.pallas_call(
        kernel, grid=(t, c_pad // ct, b), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, ct), lambda i, j, bb: (bb, i, j)),
        out_shape=jax.ShapeDtypeStruct((b, t, c_pad), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret, name="index_rescore")(nvis, cand_p, qs, ws, ks, kept)
    return out[..., :c]


def _score_operands(q, w, keys, score_dtype: str):
    """(q', w', keys', key scale) for the MMA: heads padded to a power of two (weight 0), w × d^-1/2.

    bf16: q, keys cast (exact for fp4-rounded values); scales 1. e4m3: q per (row, head) and keys per key
    multiplied by a power of two that puts their largest magnitude in [64, 128) before the cast; the inverse
    powers go into w and the key scale (exact: multiplications by powers of two)."""
    b, t, heads, d = q.shape
    hp = 1 << max(0, (heads - 1).bit_length())
    q = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, 0), (0, hp - heads), (0, 0)))
    w = jnp.pad(w.astype(jnp.float32) * d**-0.5, ((0, 0), (0, 0), (0, hp - heads)))
    if score_dtype == "bfloat16":   # bf16 keys (the cache's dtype on the GPU) pass through uncopied
        return q.astype(jnp.bfloat16), w, keys.astype(jnp.bfloat16), jnp.ones(keys.shape[:2], jnp.float32)
    keys = keys.astype(jnp.float32)
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
