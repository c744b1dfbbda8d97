"""Interleaved (GPT-J) rotary embedding on the last ``rope_dim`` features (`MODEL.md` §B.5)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig, yarn_inv_freq

DIGIT_BITS = 8  # positions are split into base-256 digits
DIGITS = 3  # 3 digits cover positions 0 … 2^24 − 1 (16.7M, far past the 1M context)
MAX_POSITION = 1 << (DIGIT_BITS * DIGITS)


def inv_frequencies(cfg: ModelConfig, ratio: int) -> tuple[float, ...]:
    """f_i (rope_dim/2 float64 values): plain theta for window-only layers, YaRN for compressed ones.
    A tuple, so modules can hold it as a static attribute (and so the tables below can be cached)."""
    return tuple(float(f) for f in np.asarray(yarn_inv_freq(cfg, ratio), np.float64))


@functools.lru_cache(maxsize=64)
def _digit_tables(inv_freq: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin f32 [DIGITS, 256, rope_dim/2] of the angle d·256^l·f_i, reduced mod 2π in float64 on the host.

    MODEL.md §B.5 prefers a float64 angle: p·f_i formed in f32 is off by ~p·f_i·2^-24 (1e-2 in cos at p = 1M).
    Each digit's angle here is exact to ~1e-9 rad before the f32 rounding of its cos/sin.
    """
    f = np.asarray(inv_freq, np.float64)
    digit = np.arange(1 << DIGIT_BITS, dtype=np.float64)
    weight = np.float64(1 << DIGIT_BITS) ** np.arange(DIGITS)
    angle = np.mod(weight[:, None, None] * digit[None, :, None] * f, 2 * np.pi)
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


# jitted: the layers call it alike (49 calls a 40-layer decode step), so a program traces and lowers it once a
# distinct (positions shape, frequencies) — inv_freq must be hashable (``inv_frequencies`` gives a tuple)
@functools.partial(jax.jit, static_argnames="inv_freq")
def rope_cos_sin(positions: jnp.ndarray, inv_freq: tuple[float, ...]) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin f32 [..., rope_dim/2] of positions·f_i for integer positions [...] with |p| < 2^24.

    p = Σ_l d_l·256^l; the per-digit cos/sin come from float64 host tables and are combined with the
    angle-addition formulas in f32, so the error is a few f32 ulps (~1e-7) at any position, not ~p·2^-24.
    Negative positions use cos(−φ) = cos φ, sin(−φ) = −sin φ.
    """
    cos_t, sin_t = _digit_tables(inv_freq)
    p = jnp.asarray(positions).astype(jnp.int32)
    magnitude = jnp.abs(p)
    cos = sin = None
    for level in range(DIGITS):
        d = (magnitude >> (DIGIT_BITS * level)) & ((1 << DIGIT_BITS) - 1)
        # jnp.take, not indexing: the same gather, a third of the tracing time (49 calls a 40-layer step)
        c = jnp.take(jnp.asarray(cos_t[level]), d, axis=0, mode="clip")
        s = jnp.take(jnp.asarray(sin_t[level]), d, axis=0, mode="clip")
        if cos is None:
            cos, sin = c, s
        else:
            cos, sin = cos * c - sin * s, sin * c + cos * s
    return cos, jnp.where((p < 0)[..., None], -sin, sin)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq, *, inverse: bool = False) -> jnp.ndarray:
    """Rotate pairs (x[n+2i], x[n+2i+1]) of the last 2·len(inv_freq) features by ±positions·f_i.

    x: [..., width]; positions: integer array broadcastable to x.shape[:-1], |p| < 2^24. Math in f32 on the
    rotated slice, result cast back to x.dtype; the un-rotated slice is untouched.
    """
    rope_dim = 2 * len(inv_freq)
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    cos, sin = rope_cos_sin(positions, tuple(float(f) for f in inv_freq))  # [..., rope_dim/2]
    if inverse:
        sin = -sin
    pairs = tail.astype(jnp.float32).reshape(*tail.shape[:-1], rope_dim // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)
    rotated = rotated.reshape(tail.shape).astype(x.dtype)
    return jnp.concatenate([head, rotated], axis=-1)
