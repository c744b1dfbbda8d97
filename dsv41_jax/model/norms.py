"""Linear layers and RMSNorm with mlx-lm's rounding (`MODEL.md` §B.1, §C.3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

HIGHEST = jax.lax.Precision.HIGHEST


def linear(x: jnp.ndarray, weight: jnp.ndarray) -> jnp.ndarray:
    """y = x · weightᵀ, weight [out, in]; f32 accumulation, result in the promoted dtype of x and weight."""
    out_dtype = jnp.promote_types(x.dtype, weight.dtype)
    if out_dtype == jnp.float32:
        x, weight = x.astype(jnp.float32), weight.astype(jnp.float32)
    y = jnp.einsum("...i,oi->...o", x, weight, preferred_element_type=jnp.float32, precision=HIGHEST)
    return y.astype(out_dtype)


def rms_normalize(x: jnp.ndarray, eps: float) -> jnp.ndarray:
    """x · (mean(x²) + eps)^(-1/2) over the last axis, in f32."""
    x = x.astype(jnp.float32)
    # 1/sqrt (both correctly rounded), as MLX computes it, rather than XLA's rsqrt, which is off by an ulp at
    # times (the ulp flips bf16 roundings against mlx-lm). The barrier stops XLA rewriting 1/sqrt into rsqrt.
    root = jax.lax.optimization_barrier(jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))
    return x * (1.0 / root)


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

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return linear(x, self.weight[...])


class RMSNorm(nnx.Module):
    """RMSNorm with a learned ``weight [dim]``."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return rms_norm(x, self.weight[...], self.eps)
