"""Fake-quantization rounding points of the official cache formats (`MODEL.md` §C.2).

Each function quantizes a tensor blockwise along its last axis and immediately dequantizes it, returning the
input dtype. As in mlx-lm, a tensor whose last dim is not a multiple of the block is returned unrounded.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

FP8_MAX = 448.0
FP4_MAX = 6.0
_FP4_LEVELS = jnp.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], jnp.float32)


def _blocks(x: jnp.ndarray, block: int) -> jnp.ndarray:
    """x [..., n] -> f32 [..., n/block, block]."""
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _pow2_ceil(v: jnp.ndarray) -> jnp.ndarray:
    """2^ceil(log2(v)) for v > 0, exact (frexp instead of a rounded log2)."""
    mantissa, exponent = jnp.frexp(v)  # v = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    return jnp.ldexp(jnp.ones_like(v), exponent)


def round_to_e4m3(v: jnp.ndarray) -> jnp.ndarray:
    """v f32 (|v| ≤ 448) rounded to the nearest e4m3fn value (ties to even), in f32: what
    ``v.astype(float8_e4m3fn).astype(float32)`` means, written with ``lax.reduce_precision``. XLA's GPU backend may
    drop a narrowing-then-widening convert pair inside a fusion (its excess-precision default): measured on the
    H200, an e4m3 round trip came back off by up to 0.12 (issue 12), so the rounding point silently vanished;
    reduce_precision is kept. IEEE-style e4m3 (``reduce_precision(·, 4, 3)``) equals e4m3fn below 2^8 (same bias,
    normals); e4m3fn's extra top binade [256, 448] is the IEEE format one binade down, scaled by 2; below 2^-6
    (where reduce_precision flushes to zero) the subnormals are the multiples of 2^-9, rounded half to even."""
    mag = jnp.abs(v)
    low = lax.reduce_precision(v, exponent_bits=4, mantissa_bits=3)
    high = 2.0 * lax.reduce_precision(0.5 * v, exponent_bits=4, mantissa_bits=3)
    subnormal = jnp.round(v * 512.0) / 512.0
    return jnp.where(mag >= 128.0, high, jnp.where(mag < 2.0**-6, subnormal, low))


def round_e2m1(y: jnp.ndarray) -> jnp.ndarray:
    """Nearest e2m1 level, ties to the even code (`MODEL.md` §C.2); y already within ±6."""
    mag = jnp.abs(y)
    code = jnp.zeros(mag.shape, jnp.int32)
    for threshold in (0.25, 1.25, 2.5, 5.0):  # ties at these go down (to the even code)
        code = code + (mag > threshold).astype(jnp.int32)
    for threshold in (0.75, 1.75, 3.5):  # ties at these go up (to the even code)
        code = code + (mag >= threshold).astype(jnp.int32)
    return jnp.sign(y) * _FP4_LEVELS[code]


def fake_quant_fp8(x: jnp.ndarray, block: int = 32) -> jnp.ndarray:
    """e4m3 values with a power-of-two scale per block of ``block`` (rounding point #1: window KV)."""
    if x.shape[-1] % block:
        return x
    v = _blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(v), axis=-1, keepdims=True), 1e-4)
    scale = _pow2_ceil(amax / FP8_MAX)
    y = round_to_e4m3(jnp.clip(v / scale, -FP8_MAX, FP8_MAX))
    return (y * scale).reshape(x.shape).astype(x.dtype)


def fake_quant_fp4(x: jnp.ndarray, block: int, e4m3_scale: bool = False) -> jnp.ndarray:
    """e2m1 values with one scale per block of ``block``.

    ``e4m3_scale``: the scale is ``e4m3(amax/6)`` (rounding point #2: compressed KV, block 16); otherwise a power
    of two ``2^ceil(log2(amax/6))`` (points #3/#4: index keys and index queries, block 32).
    """
    if x.shape[-1] % block:
        return x
    v = _blocks(x, block)
    floor = FP4_MAX * 2.0**-9 if e4m3_scale else FP4_MAX * 2.0**-126
    amax = jnp.maximum(jnp.max(jnp.abs(v), axis=-1, keepdims=True), floor)
    if e4m3_scale:
        scale = round_to_e4m3(amax / FP4_MAX)
    else:
        scale = _pow2_ceil(amax / FP4_MAX)
    y = round_e2m1(jnp.clip(v / scale, -FP4_MAX, FP4_MAX))
    return (y * scale).reshape(x.shape).astype(x.dtype)


def round_window_kv(x: jnp.ndarray, enabled: bool) -> jnp.ndarray:
    """Point #1: fp8 window KV rows [.., head_dim]."""
    return fake_quant_fp8(x, 32) if enabled else x


def round_compressed_kv(x: jnp.ndarray, enabled: bool) -> jnp.ndarray:
    """Point #2: fp4 compressed entries [.., head_dim] with e4m3 scales per 16."""
    return fake_quant_fp4(x, 16, e4m3_scale=True) if enabled else x


def round_index(x: jnp.ndarray, enabled: bool) -> jnp.ndarray:
    """Points #3 and #4: fp4 index keys / queries [.., index_head_dim] with power-of-two scales per 32."""
    return fake_quant_fp4(x, 32) if enabled else x
