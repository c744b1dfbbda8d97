"""XLA implementation of the block-scaled fp8 matmul, and the definition of its result: dequantise W
(``formats.decode_fp8``; exact in bf16 and f32) in the activations' dtype, then one dot with f32 accumulation, as
the model's dense GEMMs (``model.norms.linear``). The CPU path and the fallback."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.formats import decode_fp8

HIGHEST = jax.lax.Precision.HIGHEST


def fp8_matmul_xla(x: jax.Array, codes: jax.Array, scales: jax.Array, *, groups: int, out_dtype) -> jax.Array:
    """y [..., N] = x [..., G·K] · Wᵀ per group (W [N, K] = G row blocks of N/G rows; group g reads x's columns
    g·K .. (g+1)·K), W dequantised in x's dtype, products and f32 accumulation at HIGHEST, then ``out_dtype``."""
    w = decode_fp8(codes, scales, x.dtype)
    if groups == 1:
        y = jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32, precision=HIGHEST)
    else:
        n, k = w.shape
        xg = x.reshape(*x.shape[:-1], groups, k)
        y = jnp.einsum("...gi,goi->...go", xg, w.reshape(groups, n // groups, k),
                       preferred_element_type=jnp.float32, precision=HIGHEST)
        y = y.reshape(*x.shape[:-1], n)
    return y.astype(out_dtype)
