"""Engram: the n-gram memory added to the streams of an engram layer before its attention HC mix
(`MODEL.md` §B.12, VISION.md §V.E.4).

The hash runs on the host (`dsv41_jax.engram`); the model gets the absolute table rows as an input
(`EngramInput`), and with the tables on the host (``tables="host"``, `dsv41_jax.engram.HostTables`) the gathered
rows themselves. Under a mesh the device tables are split by hash column (`sharding.kernels.engram_gather`).
Parameters (official names under ``layers.L.engram.``): ``embed.weight`` e4m3 codes
``[rows, head_dim]`` and ``embed.scale`` ue8m0 bytes ``[rows, head_dim/32]`` — the table is held as stored, not
dequantised (98 GB a layer in the release) — ``wkv.weight`` ``[(S+1)·D, cols·head_dim]`` (dequantised like the
other dense matrices), ``q_weight`` / ``k_weight`` f32 ``[S, D]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from sharding.kernels import engram_gather  # split by hash column when sharded

from ..config import ModelConfig
from ..formats import BLOCK as SCALE_GROUP  # one ue8m0 scale per 32 dims of a table row (§B.12)
from ..formats import decode_ue8m0
from .dense import Dense
from .quant import round_gemm_input

GATE_FLOOR = 1e-6  # sqrt(max(|dot|, 1e-6)) (§B.12)


@struct.dataclass
class EngramInput:
    """What the host hashed for one call. rows int32 [B, T, n_engram_layers, cols]: absolute table rows of every
    engram layer (`dsv41_jax.engram.Hasher.rows`, < 2³¹); text bool [B, T]: False at image positions, where the
    gate is 0 (VISION.md §V.E.4); gathered uint8 [B, T, n_engram_layers, cols, d + d/32] or None: those rows as
    stored (e4m3 code bytes, then the ue8m0 scale bytes), gathered on the host — what a model with
    ``tables="host"`` reads instead of a table."""

    rows: jnp.ndarray
    text: jnp.ndarray
    gathered: jnp.ndarray | None = None


def decode_rows(codes: jnp.ndarray, scale_bytes: jnp.ndarray, dtype) -> jnp.ndarray:
    """codes e4m3 [..., d], scale_bytes uint8 [..., d/32] → rows [..., d] in ``dtype`` (exact: e4m3 · 2^k fits
    bf16), decoded after the gather (only the gathered rows are touched)."""
    # 2^(e−127) exactly (the codec's ``decode_ue8m0``; byte 0 gives 0). The product is formed in ``dtype``
    # directly (a 4-bit significand times a power of two: exact in bf16 as in f32, bf16 having f32's exponent
    # range, down to the normal range's 2^-126), so no f32 copy of the rows is made.
    scale = decode_ue8m0(scale_bytes).astype(dtype)
    grouped = codes.astype(dtype).reshape(*codes.shape[:-1], -1, SCALE_GROUP) * scale[..., None]
    return grouped.reshape(codes.shape)


def _rms_inv(v: jnp.ndarray, eps: float) -> jnp.ndarray:
    """(mean(v²) + eps)^(−1/2) over the last axis: v [..., D] f32 → [...]."""
    return jax.lax.rsqrt(jnp.mean(v * v, axis=-1) + eps)


def unpack_rows(packed: jnp.ndarray, dim: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """packed uint8 [..., d + d/32] (codes then scale bytes) → (codes e4m3 [..., d], scale bytes [..., d/32])."""
    return jax.lax.bitcast_convert_type(packed[..., :dim], jnp.float8_e4m3fn), packed[..., dim:]


def engram_columns(cfg: ModelConfig) -> int:
    """Hash columns a layer reads per token: (max_ngram − 1) orders × heads (24 in the release)."""
    return (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads


class EngramTable(nnx.Module):
    """``embed.weight`` e4m3 [rows, d] and ``embed.scale`` ue8m0 bytes [rows, d/32] of engram layer ``layer``;
    rows are decoded after the gather. ``cfg``: the config the model is built with (a sharded model's padded
    one: its primes give the split by hash column)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        rows, dim = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)], cfg.engram_head_dim
        self.cfg, self.layer = cfg, layer
        codes = jax.random.normal(rngs.params(), (rows, dim), jnp.float32) * 64.0
        self.weight = nnx.Param(codes.astype(jnp.float8_e4m3fn))
        self.scale = nnx.Param(jnp.full((rows, dim // SCALE_GROUP), 127 - 6, jnp.uint8))

    def gather(self, idx: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        """idx int [..., C] absolute rows → (codes e4m3 [..., C, d], scale bytes [..., C, d/32]), replicated."""
        return engram_gather(self.weight[...], self.scale[...], idx, cfg=self.cfg, layer=self.layer)

    def __call__(self, idx: jnp.ndarray, dtype) -> jnp.ndarray:
        """idx int [..., C] → rows [..., C, d] in ``dtype``."""
        return decode_rows(*self.gather(idx), dtype)


class Engram(nnx.Module):
    """``layers.L.engram``: gated n-gram value added to every stream (§B.12 "Forward")."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs, tables: str = "device",
                 dense: Dense = Dense(), gemm_inputs: str = "exact"):
        """``tables``: "device" (``embed`` is a parameter) or "host" (no table here: every call brings its
        gathered rows, `EngramInput.gathered`); ``gemm_inputs`` "fp8": the decoded rows rounded before ``wkv``
        (``quant.round_gemm_input``)."""
        if tables not in ("device", "host"):
            raise ValueError(f"engram tables {tables!r}: use 'device' or 'host'")
        s, d = cfg.hc_mult, cfg.hidden_size
        self.gemm_inputs = gemm_inputs
        self.index = cfg.engram_layer_ids.index(layer)  # this layer's slot in EngramInput.rows
        self.eps = cfg.rms_norm_eps
        self.head_dim = cfg.engram_head_dim
        if tables == "device":
            self.embed = EngramTable(cfg, layer, rngs=rngs)
        self.wkv = dense.linear(engram_columns(cfg) * cfg.engram_head_dim, (s + 1) * d, dtype=dtype, rngs=rngs,
                                rule=f"layers.{layer}.engram.wkv")
        self.q_weight = nnx.Param(jnp.ones((s, d), jnp.float32))
        self.k_weight = nnx.Param(jnp.ones((s, d), jnp.float32))

    def __call__(self, streams: jnp.ndarray, inputs: EngramInput) -> jnp.ndarray:
        """streams [B, T, S, D] → streams [B, T, S, D] (same dtype)."""
        b, t, s, d = streams.shape
        rows = self._rows(inputs, streams.dtype).reshape(b, t, -1)  # [B, T, C·d_e]
        kv = self.wkv(round_gemm_input(rows, self.gemm_inputs))  # [B, T, (S+1)·D] in the model dtype
        key = kv[..., : s * d].reshape(b, t, s, d).astype(jnp.float32)
        value = kv[..., s * d:].astype(jnp.float32)
        x = streams.astype(jnp.float32)
        weight = self.q_weight[...] * self.k_weight[...]  # [S, D]
        # cosine of the RMS-normed stream and key, weighted by q_w ⊙ k_w, over sqrt(D): the norms are scalars a
        # row, so Σ x·w·key · rms⁻¹(x) · rms⁻¹(key) — three sums over D of the same inputs, one pass for XLA
        # (normalising x and key first would read them twice more)
        dot = jnp.sum(x * weight * key, axis=-1) * _rms_inv(x, self.eps) * _rms_inv(key, self.eps) * d**-0.5
        gate = jax.nn.sigmoid(jnp.sign(dot) * jnp.sqrt(jnp.maximum(jnp.abs(dot), GATE_FLOOR)))  # [B, T, S]
        gate = jnp.where(inputs.text[..., None], gate, 0.0)
        return (x + gate[..., None] * value[:, :, None, :]).astype(streams.dtype)

    def _rows(self, inputs: EngramInput, dtype) -> jnp.ndarray:
        """This layer's table rows of the call, decoded: [B, T, C, d_e] in ``dtype``."""
        if inputs.gathered is not None:
            return decode_rows(*unpack_rows(inputs.gathered[:, :, self.index], self.head_dim), dtype)
        if not hasattr(self, "embed"):
            raise ValueError("this engram layer's tables are on the host: pass the gathered rows "
                             "(EngramInput.gathered, dsv41_jax.engram.HostTables)")
        return self.embed(inputs.rows[:, :, self.index], dtype)
