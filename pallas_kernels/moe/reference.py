"""The routed experts' test oracle (MODEL.md §B.10): one pass per expert over all rows, in float32; the tests and
benchmarks compare every implementation of ``ops.routed_experts`` (``pallas_kernels.registry``) with it, the
model never calls it. fp4 experts are decoded first (``dsv41_jax.formats.decode_fp4``).

Every product is computed in float32 from the bf16 inputs; the only rounding besides float32 is the
contract's bf16 cast of the activation before the down projection.

Precision: every dot asks for the F32_F32_F32 algorithm (f32 operands, products and accumulation): on a GPU
a float32 dot otherwise may run in TF32. The activation's bf16 rounding is ``lax.reduce_precision``, not an
``astype`` round trip: XLA's GPU backend may drop a bf16 round trip inside a fusion (its "excess precision"
default), which showed here on a GPU as an error against the per-pair numpy oracle while the dots themselves
were exact, with or without the scan (see docs/BENCHMARKS.md, section "Rounding points on the GPU").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32_DOT = jax.lax.DotAlgorithmPreset.F32_F32_F32  # see the module docstring


def swiglu(g: jax.Array, u: jax.Array, limit: float) -> jax.Array:
    """Clamped SwiGLU in float32: silu(min(g, lim)) * clip(u, -lim, lim) (gate clipped above only)."""
    g = jnp.minimum(g, limit)
    return g * jax.nn.sigmoid(g) * jnp.clip(u, -limit, limit)


def routed_experts_reference(
    x: jax.Array,
    topk_ids: jax.Array,
    topk_weights: jax.Array,
    w1: jax.Array,
    w3: jax.Array,
    w2: jax.Array,
    *,
    swiglu_limit: float,
) -> jax.Array:
    """y [N, D] f32 = sum_j w[n, j] * (bf16(act) . w2[e]^T), act from g = x.w1[e]^T, u = x.w3[e]^T.

    x: [N, D]; topk_ids: [N, k] (ids outside [0, E) contribute nothing); topk_weights: [N, k];
    w1, w3: [E, F, D]; w2: [E, D, F]. One pass per expert over all rows (a reference, not fast).
    """
    num_experts = w1.shape[0]
    xf = x.astype(jnp.float32)
    hp = F32_DOT
    experts = jnp.arange(num_experts, dtype=topk_ids.dtype)
    hit = topk_ids[:, :, None] == experts[None, None, :]  # [N, k, E]
    combine = jnp.sum(jnp.where(hit, topk_weights[:, :, None].astype(jnp.float32), 0.0), axis=1)

    def one_expert(acc, e):
        g = jnp.dot(xf, w1[e].astype(jnp.float32).T, precision=hp)
        u = jnp.dot(xf, w3[e].astype(jnp.float32).T, precision=hp)
        act = jax.lax.reduce_precision(swiglu(g, u, swiglu_limit), exponent_bits=8, mantissa_bits=7)  # bf16
        y_e = jnp.dot(act, w2[e].astype(jnp.float32).T, precision=hp)
        c = combine[:, e][:, None]
        return acc + jnp.where(c != 0, c * y_e, 0.0), None

    y0 = jnp.zeros((x.shape[0], w2.shape[1]), jnp.float32)
    y, _ = jax.lax.scan(one_expert, y0, jnp.arange(num_experts))
    return y
