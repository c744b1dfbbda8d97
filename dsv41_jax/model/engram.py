"""Engram: the n-gram memory added to the streams of an engram layer before its attention HC mix
(`MODEL.md` §B.12, VISION.md §V.E.4).

The hash runs on the host (`dsv41_jax.engram`); the model gets the absolute table rows as an input
(`EngramInput`). Parameters (official names under ``layers.L.engram.``): ``embed.weight`` e4m3 codes
``[rows, head_dim]`` and ``embed.scale`` ue8m0 bytes ``[rows, head_dim/32]`` — the table is held as stored, not
dequantised (98 GB a layer in the release) — ``wkv.weight`` ``[(S+1)·D, cols·head_dim]`` (dequantised like the
other dense matrices), ``q_weight`` / ``k_weight`` f32 ``[S, D]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from ..config import ModelConfig
from .norms import Linear, rms_normalize

SCALE_GROUP = 32  # one ue8m0 scale per 32 dims of a table row (§B.12)
GATE_FLOOR = 1e-6  # sqrt(max(|dot|, 1e-6)) (§B.12)


@struct.dataclass
class EngramInput:
    """What the host hashed for one call. rows int32 [B, T, n_engram_layers, cols]: absolute table rows of every
    engram layer (`dsv41_jax.engram.Hasher.rows`, < 2³¹); text bool [B, T]: False at image positions, where the
    gate is 0 (VISION.md §V.E.4)."""

    rows: jnp.ndarray
    text: jnp.ndarray


def engram_columns(cfg: ModelConfig) -> int:
    """Hash columns a layer reads per token: (max_ngram − 1) orders × heads (24 in the release)."""
    return (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads


class EngramTable(nnx.Module):
    """``embed.weight`` e4m3 [rows, d] and ``embed.scale`` ue8m0 bytes [rows, d/32]; rows are decoded on lookup."""

    def __init__(self, rows: int, dim: int, *, rngs: nnx.Rngs):
        codes = jax.random.normal(rngs.params(), (rows, dim), jnp.float32) * 64.0
        self.weight = nnx.Param(codes.astype(jnp.float8_e4m3fn))
        self.scale = nnx.Param(jnp.full((rows, dim // SCALE_GROUP), 127 - 6, jnp.uint8))

    def __call__(self, idx: jnp.ndarray, dtype) -> jnp.ndarray:
        """idx int [..., C] → rows [..., C, d] in ``dtype`` (exact: e4m3 · 2^k fits bf16)."""
        codes = jnp.take(self.weight[...], idx, axis=0).astype(jnp.float32)
        scale_bytes = jnp.take(self.scale[...], idx, axis=0)
        # 2^(e−127) from its bits (exact); byte 0 gives 0, f32 has no normal 2^-127 (MODEL.md §C.1 ue8m0).
        scale = jax.lax.bitcast_convert_type(scale_bytes.astype(jnp.uint32) << 23, jnp.float32)
        grouped = codes.reshape(*codes.shape[:-1], -1, SCALE_GROUP) * scale[..., None]
        return grouped.reshape(codes.shape).astype(dtype)


class Engram(nnx.Module):
    """``layers.L.engram``: gated n-gram value added to every stream (§B.12 "Forward")."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        index = cfg.engram_layer_ids.index(layer)
        s, d = cfg.hc_mult, cfg.hidden_size
        self.index = index  # this layer's slot in EngramInput.rows
        self.eps = cfg.rms_norm_eps
        self.embed = EngramTable(cfg.engram_num_embeddings[index], cfg.engram_head_dim, rngs=rngs)
        self.wkv = Linear(engram_columns(cfg) * cfg.engram_head_dim, (s + 1) * d, dtype=dtype, rngs=rngs)
        self.q_weight = nnx.Param(jnp.ones((s, d), jnp.float32))
        self.k_weight = nnx.Param(jnp.ones((s, d), jnp.float32))

    def __call__(self, streams: jnp.ndarray, inputs: EngramInput) -> jnp.ndarray:
        """streams [B, T, S, D] → streams [B, T, S, D] (same dtype)."""
        b, t, s, d = streams.shape
        rows = self.embed(inputs.rows[:, :, self.index], streams.dtype).reshape(b, t, -1)  # [B, T, C·d_e]
        kv = self.wkv(rows)  # [B, T, (S+1)·D] in the model dtype
        key = kv[..., : s * d].reshape(b, t, s, d).astype(jnp.float32)
        value = kv[..., s * d:].astype(jnp.float32)
        x = streams.astype(jnp.float32)
        weight = self.q_weight[...] * self.k_weight[...]  # [S, D]
        # cosine of the RMS-normed stream and key, weighted by q_w ⊙ k_w, over sqrt(D)
        dot = jnp.sum(rms_normalize(x, self.eps) * weight * rms_normalize(key, self.eps), axis=-1) * d**-0.5
        gate = jax.nn.sigmoid(jnp.sign(dot) * jnp.sqrt(jnp.maximum(jnp.abs(dot), GATE_FLOOR)))  # [B, T, S]
        gate = jnp.where(inputs.text[..., None], gate, 0.0)
        return (x + gate[..., None] * value[:, :, None, :]).astype(streams.dtype)
