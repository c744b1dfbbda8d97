"""XLA implementation of the routed-experts op (MODEL.md §B.10): the pairs sorted by expert and two grouped
matmuls (``lax.ragged_dot_general``) in the operands' dtype with f32 accumulation, act rounded to that dtype
before the down projection, the weights applied after it (as mlx-lm); with fp8 GEMM inputs, x and the weighted
act rounded to e4m3 + ue8m0 per 32 (the weights then applied before it, as the release and mlx-vlm). The CPU
path and the fallback; the Pallas kernel (``kernel.py``) runs the same tiles of sorted pairs with bf16 operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.formats import fake_quant_fp8

HIGHEST = jax.lax.Precision.HIGHEST
_RAGGED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),  # contract x's features with the weight's last ("in") dim
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """silu(min(gate, lim)) · clip(up, ±lim) in f32, returned in the inputs' dtype (lim ≤ 0: no clamp)."""
    return clamped_swiglu_f32(gate, up, limit).astype(gate.dtype)


def clamped_swiglu_f32(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """``clamped_swiglu`` before its rounding: f32."""
    g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        g = jnp.minimum(g, limit)
        u = jnp.clip(u, -limit, limit)
    return jax.nn.silu(g) * u


def _grouped(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """Rows of x (sorted by expert, ``sizes`` rows each) times their expert's w [E, out, in]ᵀ; f32 accumulate."""
    y = jax.lax.ragged_dot_general(x, w.astype(x.dtype), sizes, _RAGGED, precision=HIGHEST,
                                   preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def routed_experts_xla(x, topk_ids, topk_weights, w1, w3, w2, *, swiglu_limit: float,
                       gemm_inputs: str = "exact") -> jax.Array:
    """y [N,D] f32 = Σ_j w[n,j] · f32(dtype(act(x·w1ᵀ, x·w3ᵀ)) · w2ᵀ), products in x's dtype, f32 accumulation.

    x [N,D]; topk_ids [N,k] int32 (ids outside [0, E) contribute nothing: sorted last, past every group);
    topk_weights [N,k] f32; w1, w3 [E,F,D], w2 [E,D,F] (float; cast to x's dtype).
    ``gemm_inputs="fp8"``: y = Σ_j f32(fp8(dtype(w[n,j] · act(fp8(x)·w1ᵀ, fp8(x)·w3ᵀ))) · w2ᵀ), fp8 = e4m3 with a
    ue8m0 scale per 32 along the GEMM's K (``formats.fake_quant_fp8``; F a multiple of 32).
    """
    fp8 = gemm_inputs == "fp8"
    n, k = topk_ids.shape
    n_experts = w1.shape[0]
    flat_ids = topk_ids.reshape(-1)
    valid = (flat_ids >= 0) & (flat_ids < n_experts)
    order = jnp.argsort(jnp.where(valid, flat_ids, n_experts), stable=True)
    sizes = jnp.bincount(jnp.where(valid, flat_ids, n_experts), length=n_experts).astype(jnp.int32)
    weights = jnp.where(valid.reshape(n, k), topk_weights.astype(jnp.float32), 0.0)
    rows = (fake_quant_fp8(x) if fp8 else x)[order // k]  # [N·k, D] sorted by expert
    g, u = _grouped(rows, w1, sizes), _grouped(rows, w3, sizes)
    if fp8:  # the pair's weight on act, in f32, before the dtype and fp8 roundings of the down input
        act = clamped_swiglu_f32(g, u, swiglu_limit) * weights.reshape(-1)[order][:, None]
        act = fake_quant_fp8(act.astype(x.dtype))
    else:
        act = clamped_swiglu(g, u, swiglu_limit)
    y_sorted = _grouped(act, w2, sizes)  # [N·k, D]
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n, k, -1)
    y = jnp.where(valid.reshape(n, k, 1), y.astype(jnp.float32), 0.0)
    return jnp.sum(y, axis=1) if fp8 else jnp.sum(y * weights[..., None], axis=1)
