"""Blocks of query rows for the XLA implementations: an op whose per-row scratch (scores, gathered keys) would not
fit at once runs ``jax.lax.map`` over blocks of rows; the caller picks the block from its budget."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def map_row_blocks(fn, rows: tuple, block: int):
    """``fn(*rows)`` computed over blocks of ``block`` query rows (``jax.lax.map``) when block < T.

    rows: arrays [B,T,...]; fn returns a pytree of [B,rows,...] arrays (or None leaves).
    """
    b, t = rows[0].shape[:2]
    if block >= t:
        return fn(*rows)
    n = -(-t // block)

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, n * block - t)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(b, n, block, *x.shape[2:]).swapaxes(0, 1)

    out = jax.lax.map(lambda xs: fn(*xs), tuple(split(x) for x in rows))
    return jax.tree.map(lambda y: y.swapaxes(0, 1).reshape(b, n * block, *y.shape[3:])[:, :t], out)
