"""KV compressor of a kv-source layer, ratio 1 or 2 (`MODEL.md` §B.7).

Groups are aligned to absolute positions (group j = tokens j·r … j·r+r−1). A segment that leaves a group open
keeps its raw ``(a, z)`` rows as pending rows; with static shapes the segment's rows are prefixed by the
``r−1`` pending rows of the cache, so row i of the combined array is at position ``offset − (r−1) + i``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import ModelConfig
from .norms import Linear, RMSNorm


class Compressor(nnx.Module):
    """``compressor.wkv`` [d, D], ``compressor.wgate`` [d, D] (r = 2 only), ``compressor.norm`` [d]; all f32."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.ratio = cfg.ratio(layer)
        f32 = jnp.float32
        self.wkv = Linear(cfg.hidden_size, cfg.head_dim, dtype=f32, rngs=rngs)
        self.wgate = Linear(cfg.hidden_size, cfg.head_dim, dtype=f32, rngs=rngs) if self.ratio > 1 else None
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=f32)

    def __call__(self, u, offset, lengths, pending_kv, pending_gate):
        """Latents of the groups this segment closes.

        u [B,T,D] (normed attention input); offset, lengths [B]; pending_* f32 [B,r−1,d] or None.
        Returns (latent f32 [B,G,d] (pre-RoPE, normed), entry [B,G] int32, valid [B,G] bool,
        new pending_kv, new pending_gate). G = ⌈(T + r − 1)/r⌉ static slots; slot g holds entry
        ``offset // r + g``, valid iff that group closes within the segment's ``lengths`` rows.
        """
        r = self.ratio
        batch, t = u.shape[:2]
        n_slots = (t + r - 1) // r
        entry = offset[:, None] // r + jnp.arange(n_slots)[None, :]
        valid = entry < ((offset + lengths) // r)[:, None]
        if r == 1:
            # bf16 u times the f32 weight promotes to f32: no rounding before the norm (mlx-lm, §B.7).
            return self.norm(self.wkv(u)), entry, valid, None, None
        rows_kv = jnp.concatenate([pending_kv, self.wkv(u)], axis=1)  # [B, T+r−1, d] f32 (promoted, §B.7)
        rows_gate = jnp.concatenate([pending_gate, self.wgate(u)], axis=1)
        pend = offset % r
        first = r * jnp.arange(n_slots)[None, :] - pend[:, None] + (r - 1)  # combined row of the group's first token
        idx = jnp.clip(first[..., None] + jnp.arange(r), 0, t + r - 2).reshape(batch, -1)  # [B, G·r]
        kv = _take_rows(rows_kv, idx).reshape(batch, n_slots, r, -1)
        gate = _take_rows(rows_gate, idx).reshape(batch, n_slots, r, -1)
        pooled = jnp.sum(kv * jax.nn.softmax(gate, axis=2), axis=2)  # [B, G, d] f32
        pooled = jnp.where(valid[..., None], pooled, 1.0)  # slots that close nothing: keep the norm finite
        latent = self.norm(pooled.astype(u.dtype))
        keep = lengths[:, None] + jnp.arange(r - 1)[None, :]  # rows of the (new) open group
        return latent, entry, valid, _take_rows(rows_kv, keep), _take_rows(rows_gate, keep)


def _take_rows(x: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
    """x [B,N,d], idx [B,M] -> [B,M,d]."""
    return jnp.take_along_axis(x, idx[..., None], axis=1)


def write_rows(buf: jnp.ndarray, entry: jnp.ndarray, valid: jnp.ndarray, rows: jnp.ndarray) -> jnp.ndarray:
    """buf [B,N,w] with rows [B,G,w] written at entry [B,G] where valid (others dropped)."""
    target = jnp.where(valid, entry, buf.shape[1])  # out of range -> dropped
    batch_idx = jnp.arange(buf.shape[0])[:, None]
    return buf.at[batch_idx, target].set(rows.astype(buf.dtype), mode="drop")
