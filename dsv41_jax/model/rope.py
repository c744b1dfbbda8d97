"""Interleaved (GPT-J) rotary embedding on the last ``rope_dim`` features (`MODEL.md` §B.5)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig, yarn_inv_freq


def inv_frequencies(cfg: ModelConfig, ratio: int) -> tuple[float, ...]:
    """f_i (rope_dim/2 values, rounded to f32): plain theta for window-only layers, YaRN for compressed ones.
    A tuple, so modules can hold it as a static attribute."""
    return tuple(float(f) for f in np.asarray(yarn_inv_freq(cfg, ratio), np.float64).astype(np.float32))


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq, *, inverse: bool = False) -> jnp.ndarray:
    """Rotate pairs (x[n+2i], x[n+2i+1]) of the last 2·len(inv_freq) features by ±positions·f_i.

    x: [..., width]; positions: int or float array broadcastable to x.shape[:-1]. Math in f32 on the rotated
    slice, result cast back to x.dtype; the un-rotated slice is untouched.
    """
    inv_freq = np.asarray(inv_freq, np.float32)
    rope_dim = 2 * inv_freq.shape[0]
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., rope_dim/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if inverse:
        sin = -sin
    pairs = tail.astype(jnp.float32).reshape(*tail.shape[:-1], rope_dim // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)
    rotated = rotated.reshape(tail.shape).astype(x.dtype)
    return jnp.concatenate([head, rotated], axis=-1)
