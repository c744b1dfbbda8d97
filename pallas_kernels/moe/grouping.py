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


# Up to this many pairs (a decode step: rows × k), the plan is computed by pairwise comparisons ([P, P] and
# [T, P] masks, a few fused kernels) instead of a sort, cumsums and searches over the experts (~27 small
# kernels a layer on the H200; BENCHMARKS.md "Decode: fewer launches").
DENSE_MAX_PAIRS = 256


def plan_tiles(topk_ids: jax.Array, num_experts: int, block_m: int) -> TilePlan:
    """Sort the pairs of ``topk_ids`` [N, k] by expert (stable by token) and build the tile table.

    Pairs whose id is outside [0, E) are dropped: sorted past every expert and given no tile. The two
    implementations (sort, or pairwise comparisons for at most ``DENSE_MAX_PAIRS`` pairs) give equal plans; one
    row's pairs are not sorted at all (``_one_row_plan``: a tile per pair, in slot order).
    """
    n_rows, k = topk_ids.shape
    num_pairs = n_rows * k
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    valid = (ids >= 0) & (ids < num_experts)
    if n_rows == 1 and k <= max_tiles(k, num_experts, block_m):
        return _one_row_plan(ids, valid, num_experts, block_m)
    bucket = jnp.where(valid, ids, num_experts)  # dropped pairs go to an extra last bucket
    tiles = _dense_tiles if num_pairs <= DENSE_MAX_PAIRS else _sorted_tiles
    order, pos, expert, first, count = tiles(bucket, num_experts, block_m)
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
    tile in slot order, with no sort: elementwise work only, where the comparisons of ``_dense_tiles`` took ~4
    small kernels a layer (~0.1 ms of a 40-layer step on the H200). Tile order does not change a pair's result
    (each tile is computed alone and ``pair_pos`` finds it); an expert named twice is read once for each pair."""
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


def _sorted_tiles(bucket, num_experts: int, block_m: int):
    """bucket [P] (E = dropped) -> (order [P]: pair at each sorted slot, pos [P]: each pair's sorted slot, and
    the tile table's expert, first sorted pair and count [T]), all int32."""
    num_pairs = bucket.shape[0]
    order = jnp.argsort(bucket, stable=True).astype(jnp.int32)  # stable: by token within an expert
    pos = jnp.zeros((num_pairs,), jnp.int32).at[order].set(jnp.arange(num_pairs, dtype=jnp.int32))

    counts = jnp.zeros((num_experts + 1,), jnp.int32).at[bucket].add(1)[:num_experts]
    offsets = jnp.cumsum(counts) - counts
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles_per_expert)  # inclusive: tiles [end_e - n_e, end_e) belong to expert e
    tiles_used = tile_end[-1]

    n_tiles = max_tiles(num_pairs, num_experts, block_m)
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), num_experts - 1).astype(jnp.int32)
    index_in_expert = t - (tile_end[expert] - tiles_per_expert[expert])
    first = offsets[expert] + index_in_expert * block_m
    count = jnp.clip(counts[expert] - index_in_expert * block_m, 0, block_m)
    count = jnp.where(t < tiles_used, count, 0)
    first = jnp.where(count > 0, first, 0)
    return order, pos, expert, first.astype(jnp.int32), count.astype(jnp.int32)


def _dense_tiles(bucket, num_experts: int, block_m: int):
    """``_sorted_tiles`` by pairwise comparisons: pair i's sorted position is the number of pairs in lower
    buckets plus the earlier pairs of its own; each used expert's first pair (its "lead") carries the expert's
    tile count, and tile t belongs to the lead whose tile range holds t."""
    num_pairs = bucket.shape[0]
    i = jnp.arange(num_pairs, dtype=jnp.int32)
    lower = bucket[None, :] < bucket[:, None]  # [P, P]: pair j's bucket sorts before pair i's
    same = bucket[None, :] == bucket[:, None]
    offset = jnp.sum(lower, axis=1, dtype=jnp.int32)  # first sorted slot of i's bucket
    rank = jnp.sum(same & (i[None, :] < i[:, None]), axis=1, dtype=jnp.int32)
    pos = offset + rank
    order = jnp.sum(jnp.where(pos[None, :] == i[:, None], i[None, :], 0), axis=1, dtype=jnp.int32)
    count = jnp.sum(same, axis=1, dtype=jnp.int32)  # pairs in i's bucket
    n_tiles_of = (count + block_m - 1) // block_m
    lead = (bucket < num_experts) & (rank == 0)
    tile_start = jnp.sum(jnp.where(lead[None, :] & lower, n_tiles_of[None, :], 0), axis=1, dtype=jnp.int32)

    t = jnp.arange(max_tiles(num_pairs, num_experts, block_m), dtype=jnp.int32)[:, None]
    owns = lead[None, :] & (tile_start[None, :] <= t) & (t < (tile_start + n_tiles_of)[None, :])  # [T, P]

    def owner(values):
        return jnp.sum(jnp.where(owns, values[None, :], 0), axis=1, dtype=jnp.int32)

    used = jnp.any(owns, axis=1)
    index_in_expert = t[:, 0] - owner(tile_start)
    count_t = jnp.where(used, jnp.clip(owner(count) - index_in_expert * block_m, 0, block_m), 0)
    first_t = jnp.where(count_t > 0, owner(offset) + index_in_expert * block_m, 0)
    return order, pos, jnp.where(used, owner(bucket), num_experts - 1), first_t, count_t
