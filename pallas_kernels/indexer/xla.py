"""XLA implementation of the fused indexer op: the row-blocked scores + ``lax.top_k`` of MODEL.md §B.8.

The [rows, entries] scores exist here, one block of query rows at a time (the caller picks the block so that
[rows, H_I, N] f32 stays within its budget). It is the CPU path and the fallback; the Pallas kernel
(``kernel.py``) selects the same entries without ever writing the score matrix.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.row_blocks import map_row_blocks

HIGHEST = lax.Precision.HIGHEST


def scores(q, w, keys, positions, ratio: int):
    """I [B,T,N] f32 (−∞ where not visible): Σ_h w[h] · ReLU(q_h · k) · d_I^(−1/2) (MODEL.md §B.8).

    q [B,T,H_I,d_I] (roped, rounded); w f32 [B,T,H_I] (already × H_I^(−1/2)); keys [B,N,d_I];
    positions [B,T]: entry j is visible at p iff j < ⌊(p+1)/r⌋.

    Both bf16: one bf16 product with f32 accumulation (tensor cores; a bf16 × bf16 product is exact in f32, so
    this equals the f32 HIGHEST product up to summation order, without an f32 copy of every key). Otherwise
    both in f32 at HIGHEST."""
    if q.dtype == keys.dtype == jnp.bfloat16:
        s = jnp.einsum("bthd,bnd->bthn", q, keys, preferred_element_type=jnp.float32)
    else:
        s = jnp.einsum("bthd,bnd->bthn", q.astype(jnp.float32), keys.astype(jnp.float32), precision=HIGHEST)
    s = jnp.maximum(s, 0.0) * q.shape[-1] ** -0.5
    s = jnp.sum(s * w[..., None], axis=2)
    n_visible = (positions + 1) // ratio
    visible = jnp.arange(keys.shape[1])[None, None, :] < n_visible[..., None]
    return jnp.where(visible, s, -jnp.inf)


def candidate_mask(block_scores, positions, *, ratio: int, block_size: int, keep_blocks: int):
    """Level 1 (candidate source, MODEL.md §B.8): keep the best K_B blocks per query, the newest always; a
    kept block whose score is −∞ is dropped. block_scores f32 [B,T,⌈N/B_c⌉] (max of each block's scores,
    −∞ past N) -> bool [B,T,⌈N/B_c⌉]."""
    b, t, n_blocks = block_scores.shape
    n_visible = (positions + 1) // ratio
    newest = jnp.where(n_visible > 0, (n_visible - 1) // block_size, -1)
    block_scores = jnp.where(jnp.arange(n_blocks) == newest[..., None], jnp.inf, block_scores)
    best, chosen = lax.top_k(block_scores, min(keep_blocks, n_blocks))
    return jnp.put_along_axis(jnp.zeros((b, t, n_blocks), bool), chosen, best > -jnp.inf, axis=-1,
                              inplace=False)


def block_maxima(s, block_size: int):
    """s [B,T,N] -> max over each block of ``block_size`` entries [B,T,⌈N/B_c⌉] (padding counts as −∞)."""
    b, t, n = s.shape
    n_blocks = math.ceil(n / block_size)
    padded = jnp.pad(s, ((0, 0), (0, 0), (0, n_blocks * block_size - n)), constant_values=-jnp.inf)
    return padded.reshape(b, t, n_blocks, block_size).max(axis=-1)


# From this many entries a GPU selects by radix (``radix_top_k``), below it by ``lax.top_k``: on a GPU the radix
# selection is the faster of the two at long rows (measured: see docs/BENCHMARKS.md, section "The decode path:
# bf16 scores and a radix selection"); on CPU lax.top_k is the faster one.
RADIX_MIN_ENTRIES = 32768
RADIX_BITS = 4  # digits per pass: 8 passes of 16 bins (8-bit digits measured slower: 256 compares an entry)


def select(s, k: int):
    """Top-K entries per query (K = min(k, N)); a pick with score −∞ becomes −1. Among equal scores the lower
    index is selected (the op's tie rule: ``lax.top_k``'s, and ``radix_top_k``'s by construction).
    s [B,T,N] -> int32 [B,T,K] (picks in no particular order)."""
    n = s.shape[-1]
    k = min(k, n)
    if n >= RADIX_MIN_ENTRIES and jax.default_backend() == "gpu":
        chosen = radix_top_k(s.reshape(-1, n), k).reshape(*s.shape[:-1], k)
        best = jnp.take_along_axis(s, chosen, axis=-1)
    else:
        best, chosen = lax.top_k(s, k)
    return jnp.where(best > -jnp.inf, chosen, -1).astype(jnp.int32)


def _sortable(s):
    """f32 -> uint32 whose unsigned order is the floats' order (−∞ lowest; −0 just below +0)."""
    u = lax.bitcast_convert_type(s.astype(jnp.float32), jnp.uint32)
    return jnp.where((u >> 31) == 1, ~u, u | jnp.uint32(1 << 31))


def radix_top_k(s, k: int):
    """Exact top-K of each row without sorting: s [R,N] f32 -> int32 [R,K] indices (K ≤ N), in index order.

    Radix select on the scores' order-preserving bits (``_sortable``), RADIX_BITS at a time from the top: each
    pass counts, among the entries that share the prefix found so far, how many fall in each digit, and keeps
    the digit holding the K-th largest. After 32 bits the prefix *is* the K-th largest key v; every entry above
    v is taken, and of the entries equal to v the lowest-indexed ones, as many as K still needs (the tie rule).
    Each pass is a compare-and-count over the row (no scatter), so the cost is linear in N."""
    r, n = s.shape
    key = _sortable(s)
    bins = jnp.arange(1 << RADIX_BITS, dtype=jnp.uint32)
    prefix = jnp.zeros((r,), jnp.uint32)
    need = jnp.full((r,), k, jnp.int32)  # how many of the entries sharing ``prefix`` K still needs
    for shift in range(32 - RADIX_BITS, -1, -RADIX_BITS):
        digit = (key >> shift) & (bins.size - 1)
        high = shift + RADIX_BITS
        match = (key >> high) == (prefix[:, None] >> high) if high < 32 else jnp.ones(key.shape, bool)
        count = jnp.sum((digit[:, None, :] == bins[None, :, None]) & match[:, None, :], axis=-1,
                        dtype=jnp.int32)  # [R, bins]
        above = jnp.cumsum(count[:, ::-1], axis=1)[:, ::-1] - count  # entries with a larger digit
        d = jnp.argmax((above < need[:, None]) & (above + count >= need[:, None]), axis=1)
        need = need - jnp.take_along_axis(above, d[:, None], axis=1)[:, 0]
        prefix = prefix | (d.astype(jnp.uint32) << shift)
    ties = key == prefix[:, None]
    take = (key > prefix[:, None]) | (ties & (jnp.cumsum(ties, axis=1, dtype=jnp.int32) <= need[:, None]))
    slot = jnp.where(take, jnp.cumsum(take, axis=1, dtype=jnp.int32) - 1, k)
    entries = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (r, n))
    return jnp.zeros((r, k), jnp.int32).at[jnp.arange(r)[:, None], slot].set(entries, mode="drop")


def index_topk_xla(q, w, keys, positions, *, ratio: int, k: int, kept_blocks=None, keep_blocks: int = 0,
                   block_size: int = 1, rows_per_block: int | None = None):
    """The op's contract (``ops.index_topk``), computed over blocks of ``rows_per_block`` query rows."""
    b, t = q.shape[:2]
    n = keys.shape[1]

    def rows(q, w, positions, kept):
        s = scores(q, w, keys, positions, ratio)
        new_kept = None
        if keep_blocks:
            new_kept = candidate_mask(block_maxima(s, block_size), positions, ratio=ratio,
                                      block_size=block_size, keep_blocks=keep_blocks)
        elif kept.shape[-1]:
            s = jnp.where(jnp.repeat(kept, block_size, axis=-1)[..., :n], s, -jnp.inf)
        return select(s, k), new_kept

    if kept_blocks is None:
        kept_blocks = jnp.zeros((b, t, 0), bool)
    return map_row_blocks(rows, (q, w, positions, kept_blocks), rows_per_block or t)
