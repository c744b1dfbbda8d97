"""Attention of one layer: low-rank q, shared K = V latent, window + compressed sparse attention with a sink,
grouped low-rank output (`MODEL.md` §B.6), and the layer's part of the shared CSA state (§B.7–§B.9)."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from flax import nnx, struct

from pallas_kernels.sparse_attention.ops import scratch_bytes_per_row, sparse_attention
from sharding.kernels import sparse_attention as sharded_attention  # shard_map'd on heads when sharded

from ..config import ModelConfig
from ..planner import KernelTiles
from .cache import LayerCache
from .compressor import Compressor, write_rows
from .dense import Dense, grouped_linear
from .indexer import Indexer, rows_per_block
from .norms import RMSNorm
from .quant import round_compressed_kv, round_gemm_input, round_window_kv
from .rope import apply_rope, inv_frequencies


class Segment(NamedTuple):
    """The rows of one call. positions [B,T] = offset + t; valid [B,T] = t < lengths; offset, lengths [B]."""

    positions: jnp.ndarray
    valid: jnp.ndarray
    offset: jnp.ndarray
    lengths: jnp.ndarray


@struct.dataclass
class CsaState:
    """What attention layers publish for later layers within one call (`MODEL.md` §B.7–§B.9): a frozen pytree
    each layer takes and returns (``Attention.__call__``), indexed by the publishing layer.

    ``kv[L]``: layer L's compressed entries [B,N,d] (kv sources, after this call's writes); ``index_keys[L]``:
    its index keys [B,N,d_I] (kv-and-index sources); ``topk[L]`` int32 [B,T,K] (−1 = none): its selections
    (index sources); ``candidates`` bool [B,T,⌈N/B_c⌉]: the candidate source's kept blocks (None before it).
    Entries of layers that publish nothing (or have not run yet) are None.
    """

    kv: tuple
    index_keys: tuple
    topk: tuple
    candidates: jnp.ndarray | None = None

    @classmethod
    def empty(cls, layers: int) -> CsaState:
        return cls(kv=(None,) * layers, index_keys=(None,) * layers, topk=(None,) * layers)

    def published(self, layer: int, *, kv=None, index_keys=None, topk=None) -> CsaState:
        """This state with layer ``layer``'s given entries set."""
        def put(entries: tuple, value) -> tuple:
            return entries if value is None else entries[:layer] + (value,) + entries[layer + 1:]

        return self.replace(kv=put(self.kv, kv), index_keys=put(self.index_keys, index_keys),
                            topk=put(self.topk, topk))


def window_in_order(ring: jnp.ndarray, offset: jnp.ndarray) -> jnp.ndarray:
    """ring [B,W,d] (slot p mod W) -> rows at positions offset−W … offset−1, in order."""
    w = ring.shape[1]
    slots = (offset[:, None] - w + jnp.arange(w)[None, :]) % w
    return jnp.take_along_axis(ring, slots[..., None], axis=1)


def updated_ring(keys: jnp.ndarray, offset: jnp.ndarray, lengths: jnp.ndarray, w: int) -> jnp.ndarray:
    """keys [B,W+T,d] (row i at position offset−W+i) -> the ring after ``lengths`` new rows: slot s holds the
    latest position q < offset+lengths with q ≡ s (mod W)."""
    end = offset + lengths
    q = (end - w)[:, None] + (jnp.arange(w)[None, :] - (end - w)[:, None]) % w  # [B,W] positions per slot
    return jnp.take_along_axis(keys, (q - offset[:, None] + w)[..., None], axis=1)


class Attention(nnx.Module):
    """``attn.*`` of one layer; owns a compressor (kv sources) and an indexer (index sources)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rounding: bool, impl: str, rngs: nnx.Rngs,
                 indexer_impl: str = "xla", tiles: KernelTiles | None = None, dense: Dense = Dense(),
                 gemm_inputs: str = "exact"):
        """``tiles``: the plan's kernel tiles (``planner.kernel_tiles``; None: the ops' defaults); ``dense``: how
        the fp8-stored projections are held (`model/dense.py`); ``gemm_inputs``: "fp8" rounds the inputs of
        ``wq_a``, ``wkv``, ``wq_b`` and ``wo_b`` (and the indexer's ``wq_b``) first (``quant.round_gemm_input``;
        ``wo_a``'s, the compressor's and ``weights_proj``'s stay as they are, as in mlx-vlm)."""
        D, d, H = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
        self.layer = layer
        self.n_heads, self.head_dim, self.groups = H, d, cfg.o_groups
        self.ratio = cfg.ratio(layer)
        self.window_size = cfg.sliding_window
        self.rounding = rounding
        self.impl = impl
        self.tiles = tiles
        self.gemm_inputs = gemm_inputs
        self.role = cfg.role(layer)
        self.kv_src = cfg.kv_source(layer)
        self.idx_src = cfg.index_source(layer)
        self.ik_src = cfg.index_key_source(layer) if layer in cfg.index_source_layer_ids else None
        self.inv_freq = inv_frequencies(cfg, self.ratio)
        proj = lambda n_in, n_out, name: dense.linear(n_in, n_out, dtype=dtype, rngs=rngs, rule=f"layers.0.attn.{name}")
        self.wq_a = proj(D, cfg.q_lora_rank, "wq_a")
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype=dtype)
        self.wq_b = proj(cfg.q_lora_rank, H * d, "wq_b")
        self.wkv = proj(D, d, "wkv")
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.wo_a = proj(H * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, "wo_a")
        self.wo_b = proj(cfg.o_groups * cfg.o_lora_rank, D, "wo_b")
        self.attn_sink = nnx.Param(jnp.zeros((H,), jnp.float32))
        self.compressor = Compressor(cfg, layer, rngs=rngs) if self.role == "full" else None
        is_index_source = self.ratio > 0 and layer in cfg.index_source_layer_ids
        self.indexer = (Indexer(cfg, layer, dtype=dtype, rngs=rngs, impl=indexer_impl, tiles=tiles, dense=dense,
                                gemm_inputs=gemm_inputs) if is_index_source else None)

    def __call__(self, u, seg: Segment, cache: LayerCache, csa: CsaState, row=None):
        """u [B,T,D] (normed collapse), the CSA state of the layers before -> (out [B,T,D], new LayerCache, the
        CSA state with this layer's entries published). ``row``: int32 scalar when this layer's fp8 dense
        weights are its unit's stack (``transformer._scan_run``)."""
        b, t, _ = u.shape
        u_in = round_gemm_input(u, self.gemm_inputs)  # wq_a's and wkv's input (the compressor and indexer take u)
        q_res = self.q_norm(self.wq_a(u_in, row))
        q = self.wq_b(round_gemm_input(q_res, self.gemm_inputs), row).reshape(b, t, self.n_heads, self.head_dim)
        q = apply_rope(q, seg.positions[..., None], self.inv_freq)
        kv = self.kv_norm(self.wkv(u_in, row))
        kv = round_window_kv(apply_rope(kv, seg.positions, self.inv_freq), self.rounding)
        kv = jnp.where(seg.valid[..., None], kv, 0).astype(cache.window.dtype)  # padding rows: zero, never NaN
        window = jnp.concatenate([window_in_order(cache.window, seg.offset), kv], axis=1)
        cache = cache.replace(window=updated_ring(window, seg.offset, seg.lengths, self.window_size))

        kv_pool = topk = None
        if self.ratio > 0:
            if self.compressor is not None:
                cache, csa = self._compress(u, seg, cache, csa)
            if self.indexer is not None:
                csa = self._index(u, q_res, seg, csa, row)
            kv_pool = csa.kv[self.kv_src]
            topk = csa.topk[self.idx_src]
        o = self._attend(q, kv_pool, topk, window, seg)
        o = apply_rope(o, seg.positions[..., None], self.inv_freq, inverse=True)
        return self._output(o, row), cache, csa

    def _attend(self, q, kv_pool, topk, window, seg: Segment):
        """The sparse attention op (``pallas_kernels.sparse_attention``, ``self.impl``): the kernel through the
        sharding wrapper (shard_map'd on heads under a mesh); the XLA implementation over blocks of query rows
        within the score budget (``rows_per_block``), partitioned by XLA itself."""
        kwargs = dict(window_size=self.window_size, scale=self.head_dim**-0.5)
        args = (q, kv_pool, topk, window, seg.offset - self.window_size, seg.positions, self.attn_sink[...])
        if self.impl == "pallas":
            if self.tiles is not None:  # the plan's BMQ: a decode step's (§B.3a) or a segment's (R4)
                kwargs["head_tile"] = self.tiles.decode_head_tile if q.shape[1] == 1 else self.tiles.attention_head_tile
            return sharded_attention(*args, **kwargs, impl="pallas")
        b, t, h, dh = q.shape
        k = 0 if kv_pool is None or topk is None else topk.shape[-1]
        block = rows_per_block(t, scratch_bytes_per_row(h, window.shape[1], k, dh))
        return sparse_attention(*args, **kwargs, impl="xla", rows_per_block=block)

    def _output(self, o, row=None):
        """Grouped low-rank output: group g's heads (head-major) through row block g of wo_a, then wo_b."""
        b, t = o.shape[:2]
        z = grouped_linear(self.wo_a, o.reshape(b, t, -1), self.groups, row)
        return self.wo_b(round_gemm_input(z, self.gemm_inputs), row)

    def _compress(self, u, seg: Segment, cache: LayerCache, csa: CsaState) -> tuple[LayerCache, CsaState]:
        """Close this segment's groups; publish compressed entries (and index keys) before any attention."""
        latent, entry, valid, pend_kv, pend_gate = self.compressor(
            u, seg.offset, seg.lengths, cache.pending_kv, cache.pending_gate)
        pos = entry * self.ratio  # an entry takes the position of its group's first token
        kvc = round_compressed_kv(apply_rope(latent, pos, self.inv_freq), self.rounding)
        cache = cache.replace(compressed=write_rows(cache.compressed, entry, valid, kvc),
                              pending_kv=pend_kv, pending_gate=pend_gate)
        if cache.index_keys is not None:
            ik = self.indexer.index_keys(latent, pos, self.inv_freq, self.rounding)
            cache = cache.replace(index_keys=write_rows(cache.index_keys, entry, valid, ik))
        return cache, csa.published(self.layer, kv=cache.compressed, index_keys=cache.index_keys)

    def _index(self, u, q_res, seg: Segment, csa: CsaState, row=None) -> CsaState:
        topk, kept = self.indexer.topk(u, q_res, seg.positions, csa.index_keys[self.ik_src], self.inv_freq,
                                       self.rounding, kept_blocks=csa.candidates, row=row)
        if self.indexer.is_candidate_source:
            csa = csa.replace(candidates=kept)
        return csa.published(self.layer, topk=topk)
