"""Linear layers and RMSNorm with mlx-lm's rounding (`MODEL.md` §B.1, §C.3)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

HIGHEST = jax.lax.Precision.HIGHEST


# Rows from which ``f32_matmul`` runs a bf16 input against an f32 weight as the split bf16 GEMM. From two rows the
# IEEE-f32 GEMM of the HC mix is far slower than the split GEMM in the model's step; at one row the split is no
# faster, so a batch-1 step keeps the f32 product (measured: see docs/BENCHMARKS.md, section "The HC product at few
# rows; the whole model's decode split").
SPLIT_MIN_ROWS = 2


def linear(x: jnp.ndarray, weight: jnp.ndarray) -> jnp.ndarray:
    """y = x · weightᵀ, weight [out, in]; f32 accumulation, result in the promoted dtype of x and weight."""
    return linear_f32(x, weight).astype(jnp.promote_types(x.dtype, weight.dtype))


def linear_f32(x: jnp.ndarray, weight: jnp.ndarray) -> jnp.ndarray:
    """``linear``'s f32 accumulation before its rounding to the promoted dtype: f32 [..., out]."""
    if jnp.promote_types(x.dtype, weight.dtype) == jnp.float32:
        return f32_matmul(x, weight)
    return jnp.einsum("...i,oi->...o", x, weight, preferred_element_type=jnp.float32, precision=HIGHEST)


def f32_matmul(x: jnp.ndarray, weight: jnp.ndarray) -> jnp.ndarray:
    """x [..., I] · weight [O, I]ᵀ in f32: f32(x)·f32(weight) with every product exact and f32 accumulation.

    A bf16 ``x`` against an f32 ``weight`` over ``SPLIT_MIN_ROWS`` rows or more runs as one bf16 GEMM (tensor
    cores) against the weight's exact split into three bf16 pieces, w = hi + mid + lo (8 significant bits each of
    f32's 24): each bf16·bf16 product is exact in f32 and accumulates in f32, so the result is the f32 GEMM's up
    to summation order. Otherwise an f32 GEMM at HIGHEST (IEEE f32 on a GPU, no tensor cores)."""
    rows = math.prod(x.shape[:-1])
    f32 = jnp.float32
    if x.dtype != jnp.bfloat16 or weight.dtype != f32 or rows < SPLIT_MIN_ROWS:
        return jnp.einsum("...i,oi->...o", x.astype(f32), weight.astype(f32), precision=HIGHEST)
    hi = weight.astype(jnp.bfloat16)
    rest = weight - hi.astype(f32)  # exact: w minus its rounding
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(f32)).astype(jnp.bfloat16)  # exact: the ≤ 8 bits left
    y = jnp.einsum("...i,oi->...o", x, jnp.concatenate([hi, mid, lo]), preferred_element_type=f32)
    y = y.reshape(*y.shape[:-1], 3, weight.shape[0])
    return y[..., 0, :] + (y[..., 1, :] + y[..., 2, :])


_TINY = np.float32(np.finfo(np.float32).tiny)


def rms_scale(x: jnp.ndarray, eps: float) -> jnp.ndarray:
    """(mean(x²) + eps)^(-1/2) over the last axis, f32 [..., 1]."""
    x = x.astype(jnp.float32)
    # 1/sqrt (both correctly rounded on the CPU), as MLX computes it, rather than XLA's rsqrt, which is off by an
    # ulp at times (the ulp flips bf16 roundings against mlx-lm). XLA rewrites 1/sqrt(v) into rsqrt(v), but not
    # 1/max(sqrt(v), tiny): the same value for eps > 0 (sqrt(v) >= sqrt(eps) > tiny; NaN stays NaN: XLA's max
    # propagates NaN unless its fast-min-max flags are set) that, unlike an optimization barrier, leaves the norm
    # fusible (a barrier cost two extra launches a norm at decode).
    root = jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return 1.0 / jnp.maximum(root, _TINY)


def rms_normalize(x: jnp.ndarray, eps: float) -> jnp.ndarray:
    """x · (mean(x²) + eps)^(-1/2) over the last axis, in f32."""
    return x.astype(jnp.float32) * rms_scale(x, eps)


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """RMSNorm as MLX computes it: f32 statistics, the normalized value rounded to the output dtype
    (promotion of x and weight), then multiplied by the weight in that dtype."""
    out_dtype = jnp.promote_types(x.dtype, weight.dtype)
    return rms_normalize(x, eps).astype(out_dtype) * weight.astype(out_dtype)


def random_normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype) -> jnp.ndarray:
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)


class Linear(nnx.Module):
    """``weight [out, in]`` exactly as the checkpoint stores it; no bias."""

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(random_normal(rngs, (out_features, in_features), in_features**-0.5, dtype))

    def __call__(self, x: jnp.ndarray, row=None) -> jnp.ndarray:
        """``row``: unused (the call signature of ``model.dense.Fp8Linear``, whose stacked weights need it; a
        plain weight is always the layer's own slice)."""
        return linear(x, self.weight[...])


class RMSNorm(nnx.Module):
    """RMSNorm with a learned ``weight [dim]``."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return rms_norm(x, self.weight[...], self.eps)
