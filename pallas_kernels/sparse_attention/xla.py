"""XLA implementation of the sparse attention op (MODEL.md §B.6): window scores against the window buffer as it
is, the compressed entries gathered per row, one f32 softmax with the sink in the denominator; blocks of query
rows (``rows_per_block``) keep the scores and gathered keys within the caller's scratch budget. The CPU path and
the fallback; the Pallas kernel (``kernel.py``) streams the same keys without a score matrix."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.row_blocks import map_row_blocks

HIGHEST = lax.Precision.HIGHEST


def sparse_attention_xla(q, kv_pool, topk, window, window_start, q_pos, sinks, *, window_size: int, scale: float,
                         rows_per_block: int | None = None):
    """The op's contract (``ops.sparse_attention``), computed over blocks of ``rows_per_block`` query rows.

    q [B,T,H,Dh] (RoPE applied); kv_pool [B,N,Dh] or None; topk [B,T,K] int32 (−1 = none) or None;
    window [B,S,Dh], row i at position window_start[b] + i (negative = invalid); q_pos [B,T]; sinks [H] f32.
    Returns o [B,T,H,Dh] in q's dtype.
    """
    b, t, h, dh = q.shape
    if kv_pool is None or topk is None or topk.shape[-1] == 0:
        kv_pool, topk = None, jnp.zeros((b, t, 0), jnp.int32)
    k = topk.shape[-1]
    keys_w = window.astype(jnp.float32)
    pos_w = window_start[:, None] + jnp.arange(window.shape[1])[None, :]  # [B,S]

    def rows(q, topk, q_pos):
        qf = q.astype(jnp.float32)
        p = q_pos[..., None]
        seen_w = (pos_w[:, None, :] >= 0) & (pos_w[:, None, :] <= p) & (pos_w[:, None, :] > p - window_size)
        s_w = jnp.einsum("bthd,bsd->bths", qf, keys_w, precision=HIGHEST) * scale
        logits = [jnp.where(seen_w[:, :, None, :], s_w, -jnp.inf)]
        if k:
            picked = jnp.take_along_axis(kv_pool[:, None], jnp.maximum(topk, 0)[..., None], axis=2)
            picked = picked.astype(jnp.float32)  # [B,T,K,Dh]
            s_c = jnp.einsum("bthd,btkd->bthk", qf, picked, precision=HIGHEST) * scale
            logits.append(jnp.where((topk >= 0)[:, :, None, :], s_c, -jnp.inf))
        m = jnp.maximum(jnp.max(jnp.concatenate(logits, axis=-1), axis=-1), sinks[None, None, :])  # [B,T,H]
        probs = [jnp.exp(s - m[..., None]) for s in logits]
        denom = sum(jnp.sum(pr, axis=-1) for pr in probs) + jnp.exp(sinks[None, None, :] - m)
        out = jnp.einsum("bths,bsd->bthd", probs[0], keys_w, precision=HIGHEST)
        if k:
            out = out + jnp.einsum("bthk,btkd->bthd", probs[1], picked, precision=HIGHEST)
        return (out / denom[..., None]).astype(q.dtype)

    return map_row_blocks(rows, (q, topk, q_pos), rows_per_block or t)


def scratch_bytes_per_row(heads: int, window_rows: int, topk: int, head_dim: int) -> int:
    """f32 scratch of one query row: its scores [H, S + K] and gathered keys [K, Dh] (sizes ``rows_per_block``)."""
    return 4 * (heads * (window_rows + topk) + topk * head_dim)
