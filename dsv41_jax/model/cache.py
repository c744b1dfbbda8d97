"""Decode caches with static shapes sized from a maximum context (`MODEL.md` §D, §D.5).

Per layer: a window ring (slot ``p mod W`` holds position ``p``); for kv sources also the compressed entries
``[B, ⌈max_context/r⌉, head_dim]`` (entry j valid iff ``j < offset // r``), for kv-and-index sources the index
keys, and for ratio-2 sources the raw ``(a, z)`` rows of the open group (pending, f32). One ``offset [B]``
(tokens seen) is shared by all layers.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import struct

from ..config import ModelConfig


@struct.dataclass
class LayerCache:
    """window [B,W,d]; compressed [B,N,d] | None; index_keys [B,N,d_I] | None;
    pending_kv / pending_gate f32 [B,r−1,d] | None."""

    window: jnp.ndarray
    compressed: jnp.ndarray | None = None
    index_keys: jnp.ndarray | None = None
    pending_kv: jnp.ndarray | None = None
    pending_gate: jnp.ndarray | None = None


@struct.dataclass
class Cache:
    """offset [B] int32 (tokens seen per sequence) and one LayerCache per layer."""

    offset: jnp.ndarray
    layers: tuple[LayerCache, ...]


def to_dtype(dtype) -> jnp.dtype:
    return jnp.dtype(dtype)


def compressed_capacity(max_context: int, ratio: int) -> int:
    """N_max = ⌈max_context / r⌉ entries."""
    return math.ceil(max_context / ratio)


def init_cache(cfg: ModelConfig, batch: int, max_context: int, dtype="bfloat16",
               compressed_dtype=None) -> Cache:
    """An empty cache for ``batch`` sequences of up to ``max_context`` tokens.

    ``dtype``: window rows (the model dtype). ``compressed_dtype`` (default ``dtype``): compressed entries and
    index keys. With the rounding points on, their values lie on the fp4 grid and bf16 holds them exactly; with
    them off, pass float32 to keep mlx-lm's f32 entries.
    """
    dtype = to_dtype(dtype)
    cdtype = to_dtype(compressed_dtype or dtype)
    layers = []
    for layer in range(cfg.num_hidden_layers):
        lc = LayerCache(window=jnp.zeros((batch, cfg.sliding_window, cfg.head_dim), dtype))
        if cfg.role(layer) == "full":
            r = cfg.ratio(layer)
            n = compressed_capacity(max_context, r)
            lc = lc.replace(compressed=jnp.zeros((batch, n, cfg.head_dim), cdtype))
            if layer in cfg.index_source_layer_ids:
                lc = lc.replace(index_keys=jnp.zeros((batch, n, cfg.index_head_dim), cdtype))
            if r > 1:
                pending = jnp.zeros((batch, r - 1, cfg.head_dim), jnp.float32)
                lc = lc.replace(pending_kv=pending, pending_gate=pending)
        layers.append(lc)
    return Cache(offset=jnp.zeros((batch,), jnp.int32), layers=tuple(layers))
