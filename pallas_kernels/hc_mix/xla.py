"""The XLA implementation of the comb's softmax + Sinkhorn (MODEL.md §B.3): a reduce per pass, the passes in a
loop (unrolled, 39 passes per mix dominate XLA's compile time)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sinkhorn(comb: jnp.ndarray, iters: int, eps: float) -> jnp.ndarray:
    """comb [..., S, S] -> doubly (approximately) stochastic: columns first and last, 2·iters − 1 passes."""
    def rows_then_columns(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
    return jax.lax.fori_loop(0, iters - 1, rows_then_columns, comb)


def comb_xla(logits: jnp.ndarray, iters: int, eps: float) -> jnp.ndarray:
    """logits f32 [..., S, S] -> Sinkhorn(softmax over the last axis + eps)."""
    return sinkhorn(jax.nn.softmax(logits, axis=-1) + eps, iters, eps)
