"""Group (row, expert) pairs by expert and cut each expert's run into tiles (PLANNER.md §E step 1).

Everything here is jittable with static shapes: the tile table has a static upper bound of tiles, and the
tiles past the used ones have ``count == 0`` so the kernels skip them.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class TilePlan:
    """The sorted pairs and the tile table of one block (a pytree of int32 arrays).

    pair_token: [P + block_m]  token (row of x) of each expert-sorted pair; padded with 0 so a tile's
                               ``block_m`` rows can always be read in bounds.
    pair_pos:   [N, k]         where pair (n, j) sits in the expert-sorted order (P for dropped pairs).
    pair_valid: [N, k] bool    the pair's expert id is in [0, E).
    tile_expert, tile_first, tile_count: [T]  the tile's expert, first sorted pair and number of pairs
                               (0 for unused tiles, which the kernels skip).
    """

    pair_token: jax.Array
    pair_pos: jax.Array
    pair_valid: jax.Array
    tile_expert: jax.Array
    tile_first: jax.Array
    tile_count: jax.Array


jax.tree_util.register_dataclass(
    TilePlan,
    data_fields=["pair_token", "pair_pos", "pair_valid", "tile_expert", "tile_first", "tile_count"],
    meta_fields=[],
)


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the tiles: sum_e ceil(c_e / BM) <= floor(P / BM) + E + 1, and never more than P."""
    return max(1, min(num_pairs // block_m + num_experts + 1, num_pairs))


DECODE_BLOCK_M = 16  # pairs per tile of decode-sized blocks (under 4 rows an expert on average)


def default_block_m(num_pairs: int, num_experts: int) -> int:
    """Pairs per tile: 64 (PLANNER.md §E) once experts average a tile's worth; 16 for decode-sized blocks."""
    mean_rows = num_pairs / num_experts
    if mean_rows >= 16:
        return 64
    if mean_rows >= 4:
        return 32
    return DECODE_BLOCK_M


def plan_tiles(topk_ids: jax.Array, num_experts: int, block_m: int) -> TilePlan:
    """Sort the pairs of ``topk_ids`` [N, k] by expert (stable by token) and build the tile table.

    Pairs whose id is outside [0, E) are dropped: sorted past every expert and given no tile. The sort is a
    counting sort by comparisons (``_counted_tiles``); one row's pairs are not sorted at all (``_one_row_plan``: a
    tile per pair, in slot order).
    """
    n_rows, k = topk_ids.shape
    num_pairs = n_rows * k
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    valid = (ids >= 0) & (ids < num_experts)
    if n_rows == 1 and k <= max_tiles(k, num_experts, block_m):
        return _one_row_plan(ids, valid, num_experts, block_m)
    bucket = jnp.where(valid, ids, num_experts)  # dropped pairs go to an extra last bucket
    order, pos, expert, first, count = _counted_tiles(bucket, num_experts, block_m)
    return TilePlan(
        pair_token=jnp.concatenate([order // k, jnp.zeros((block_m,), jnp.int32)]),
        pair_pos=jnp.where(valid, pos, num_pairs).reshape(n_rows, k),
        pair_valid=valid.reshape(n_rows, k),
        tile_expert=expert,
        tile_first=first,
        tile_count=count,
    )


def _one_row_plan(ids, valid, num_experts: int, block_m: int) -> TilePlan:
    """One row (a batch-1 decode step): its k pairs name k experts, distinct under top-k, so each pair is its own
    tile in slot order, with no sort: elementwise work only, where a plan by pairwise comparisons takes ~4 small
    kernels a layer (measured: see docs/BENCHMARKS.md, section "A group scan's loop inside a loop"). Tile order
    does not change a pair's result (each tile is computed alone and ``pair_pos`` finds it); an expert named twice
    is read once for each pair."""
    k = ids.shape[0]
    slot = jnp.arange(k, dtype=jnp.int32)
    return TilePlan(
        pair_token=jnp.zeros((k + block_m,), jnp.int32),
        pair_pos=jnp.where(valid, slot, k).reshape(1, k),
        pair_valid=valid.reshape(1, k),
        tile_expert=jnp.where(valid, ids, num_experts - 1),
        tile_first=jnp.where(valid, slot, 0),
        tile_count=valid.astype(jnp.int32),
    )


# Pairs a ``_counted_tiles`` block compares pairwise ([blocks, B, B] comparisons; a block's bucket counts are
# [blocks, B, E + 2] comparisons): 12,288 pairs (2,048 rows, top-6) make 48 blocks, a decode step's pairs one. The
# earlier blocks' counts are a masked [blocks, blocks, E + 2] sum, growing with the square of the pairs (57 M terms
# at 8 sequences × 2,048 rows × top-6 of 384).
COUNT_BLOCK = 256


def _counted_tiles(bucket, num_experts: int, block_m: int):
    """bucket [P] (E = dropped) -> (order [P]: pair at each sorted slot, pos [P]: each pair's sorted slot, and
    the tile table's expert, first sorted pair and count [T]), all int32: the stable sort by bucket as a counting
    sort. Pair i's slot is the pairs of lower buckets, plus those of its bucket in earlier blocks of
    ``COUNT_BLOCK`` pairs, plus the earlier ones of its own block; the prefix sums over the E + 2 buckets and the
    tiles are masked sums, and a tile's expert counts the experts whose tiles end at or before it (a search by
    comparison). Each step is a comparison and a sum (``order`` a scatter): no sort, scan or search loop; several
    times faster than an argsort, cumsums and a search loop at prefill sizes, and as fast as the pairwise
    comparisons of all the pairs at decode sizes (measured: see docs/BENCHMARKS.md, section "fp4 experts: one
    accumulator; the MoE plan as a counting sort")."""
    num_pairs = bucket.shape[0]
    block = max(1, min(COUNT_BLOCK, num_pairs))  # no pairs: no blocks
    n_blocks = -(-num_pairs // block)
    buckets = num_experts + 2  # experts, dropped pairs (E), the padding of the last block (E + 1)
    blocks = jnp.pad(bucket, (0, n_blocks * block - num_pairs), constant_values=num_experts + 1)
    blocks = blocks.reshape(n_blocks, block)

    in_block = jnp.sum(blocks[:, :, None] == jnp.arange(buckets, dtype=jnp.int32), axis=1, dtype=jnp.int32)
    counts = jnp.sum(in_block, axis=0, dtype=jnp.int32)  # [E + 2]
    lower = _exclusive_sums(counts)  # [E + 2]: pairs in lower buckets
    earlier = _exclusive_sums(in_block)  # [blocks, E + 2]: a bucket's pairs in earlier blocks
    i = jnp.arange(block, dtype=jnp.int32)
    same_before = (blocks[:, None, :] == blocks[:, :, None]) & (i[None, :] < i[:, None])  # [blocks, B, B]
    rank = jnp.sum(same_before, axis=2, dtype=jnp.int32)
    pos = lower[blocks] + jnp.take_along_axis(earlier, blocks, axis=1) + rank
    pos = pos.reshape(-1)[:num_pairs]
    order = jnp.zeros((num_pairs,), jnp.int32).at[pos].set(jnp.arange(num_pairs, dtype=jnp.int32),
                                                            unique_indices=True)

    tiles_per_expert = (counts[:num_experts] + block_m - 1) // block_m
    tile_end = _exclusive_sums(tiles_per_expert) + tiles_per_expert  # tiles [end_e - n_e, end_e) are expert e's
    n_tiles = max_tiles(num_pairs, num_experts, block_m)
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    expert = jnp.minimum(jnp.sum(tile_end[None, :] <= t[:, None], axis=1, dtype=jnp.int32), num_experts - 1)
    index_in_expert = t - (tile_end[expert] - tiles_per_expert[expert])
    first = lower[expert] + index_in_expert * block_m
    count = jnp.clip(counts[expert] - index_in_expert * block_m, 0, block_m)
    count = jnp.where(t < tile_end[-1], count, 0)
    first = jnp.where(count > 0, first, 0)
    return order, pos, expert, first.astype(jnp.int32), count.astype(jnp.int32)


def _exclusive_sums(values):
    """int32 [n, ...] -> [n, ...]: along the first axis, the sum of the rows before each (a masked [n, n, ...]
    sum: one fused kernel for the few hundred experts or blocks, where a cumsum is a chain of small ones)."""
    j = jnp.arange(values.shape[0], dtype=jnp.int32)
    before = (j[None, :] < j[:, None]).reshape(j.size, j.size, *(1,) * (values.ndim - 1))
    return jnp.sum(jnp.where(before, values[None], 0), axis=1, dtype=jnp.int32)
