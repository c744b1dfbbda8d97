"""XLA implementation of the routed-experts op (MODEL.md §B.10): the pairs sorted by expert and two grouped
matmuls (``lax.ragged_dot_general``) in the operands' dtype with f32 accumulation, act rounded to that dtype
before the down projection, the weights applied after it (as mlx-lm). The CPU path and the fallback; the Pallas
kernel (``kernel.py``) runs the same tiles of sorted pairs with bf16 operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
_RAGGED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),  # contract x's features with the weight's last ("in") dim
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """silu(min(gate, lim)) · clip(up, ±lim) in f32, returned in the inputs' dtype (lim ≤ 0: no clamp)."""
    g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        g = jnp.minimum(g, limit)
        u = jnp.clip(u, -limit, limit)
    return (jax.nn.silu(g) * u).astype(gate.dtype)


def _grouped(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """Rows of x (sorted by expert, ``sizes`` rows each) times their expert's w [E, out, in]ᵀ; f32 accumulate."""
    y = jax.lax.ragged_dot_general(x, w.astype(x.dtype), sizes, _RAGGED, precision=HIGHEST,
                                   preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def routed_experts_xla(x, topk_ids, topk_weights, w1, w3, w2, *, swiglu_limit: float) -> jax.Array:
    """y [N,D] f32 = Σ_j w[n,j] · f32(dtype(act(x·w1ᵀ, x·w3ᵀ)) · w2ᵀ), products in x's dtype, f32 accumulation.

    x [N,D]; topk_ids [N,k] int32 (ids outside [0, E) contribute nothing: sorted last, past every group);
    topk_weights [N,k] f32; w1, w3 [E,F,D], w2 [E,D,F] (float; cast to x's dtype).
    """
    n, k = topk_ids.shape
    n_experts = w1.shape[0]
    flat_ids = topk_ids.reshape(-1)
    valid = (flat_ids >= 0) & (flat_ids < n_experts)
    order = jnp.argsort(jnp.where(valid, flat_ids, n_experts), stable=True)
    sizes = jnp.bincount(jnp.where(valid, flat_ids, n_experts), length=n_experts).astype(jnp.int32)
    rows = x[order // k]  # [N·k, D] sorted by expert
    act = clamped_swiglu(_grouped(rows, w1, sizes), _grouped(rows, w3, sizes), swiglu_limit)
    y_sorted = _grouped(act, w2, sizes)  # [N·k, D]
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n, k, -1)
    weights = jnp.where(valid.reshape(n, k), topk_weights.astype(jnp.float32), 0.0)
    return jnp.sum(jnp.where(valid.reshape(n, k, 1), y.astype(jnp.float32), 0.0) * weights[..., None], axis=1)
