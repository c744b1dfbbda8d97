"""Pure-JAX reference for the fused sparse prefill attention (PLANNER.md §D, MODEL.md §B.6).

Gathers every key of every query row explicitly, then runs one float32 softmax per (row, head) with the
per-head sink in the denominator only. Slow and memory-hungry ([B, T, K + W, Dh] keys), but obviously right:
the tests' and benchmarks' oracle for every implementation of `ops.sparse_attention` (the model never calls it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Full float32 products on every backend (a float32 dot runs in TF32 on a GPU unless asked otherwise): the
# F32_F32_F32 dot algorithm, which XLA honours on GPU everywhere (see pallas_kernels/moe/reference.py).
_F32_DOT = jax.lax.DotAlgorithmPreset.F32_F32_F32


def gather_window_keys(window, window_start, q_pos, window_size: int):
    """Window keys each query row sees, in ascending position.

    window: [B, S, Dh] (row i at absolute position window_start[b] + i); window_start: [B]; q_pos: [B, T].
    Returns keys [B, T, W, Dh] and valid [B, T, W] (W = window_size): key w of row t sits at position
    q_pos - (W - 1) + w, valid when that position is >= 0 and its row lies inside the window buffer.
    """
    num_rows = window.shape[1]
    key_pos = q_pos[..., None] - (window_size - 1) + jnp.arange(window_size)
    rows = key_pos - window_start[:, None, None]
    valid = (key_pos >= 0) & (rows >= 0) & (rows < num_rows)
    keys = jax.vmap(lambda w, r: w[r])(window, jnp.clip(rows, 0, max(num_rows - 1, 0)))
    return keys, valid


def gather_compressed_keys(kv_pool, topk):
    """kv_pool: [B, N, Dh]; topk: [B, T, K] (-1 = none). Returns keys [B, T, K, Dh] and valid [B, T, K]."""
    valid = topk >= 0
    keys = jax.vmap(lambda pool, idx: pool[idx])(kv_pool, jnp.where(valid, topk, 0))
    return keys, valid


def sparse_attention_reference(q, kv_pool, topk, window, window_start, q_pos, sinks, *,
                               window_size: int, scale: float):
    """Reference sparse attention; same contract as `ops.sparse_attention`.

    q: [B, T, H, Dh]; kv_pool: [B, N, Dh]; topk: [B, T, K] int32; window: [B, S, Dh]; window_start: [B];
    q_pos: [B, T]; sinks: [H] f32. Returns o: [B, T, H, Dh] in q's dtype, computed in float32.
    """
    comp_keys, comp_ok = gather_compressed_keys(kv_pool, topk)
    win_keys, win_ok = gather_window_keys(window, window_start, q_pos, window_size)
    keys = jnp.concatenate([comp_keys, win_keys], axis=2).astype(jnp.float32)   # [B, T, K+W, Dh]
    key_ok = jnp.concatenate([comp_ok, win_ok], axis=2)                         # [B, T, K+W]
    logits = jnp.einsum("bthd,btkd->bthk", q.astype(jnp.float32), keys, precision=_F32_DOT) * scale
    logits = jnp.where(key_ok[:, :, None, :], logits, -jnp.inf)
    sinks = sinks.astype(jnp.float32)
    # The max includes the sink so that exp never overflows; the result is the same softmax (MODEL.md §B.6).
    m = jnp.maximum(logits.max(axis=-1), sinks)                                  # [B, T, H]
    weights = jnp.exp(logits - m[..., None])
    denominator = weights.sum(axis=-1) + jnp.exp(sinks - m)
    o = jnp.einsum("bthk,btkd->bthd", weights, keys, precision=_F32_DOT) / denominator[..., None]
    o = jnp.where(key_ok.any(axis=-1)[:, :, None, None], o, 0.0)                # no valid key -> zeros
    return o.astype(q.dtype)
