"""Lightning indexer with candidate blocks (`MODEL.md` §B.8): per query, the top-k compressed entries."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import ModelConfig
from .norms import _HIGHEST, Linear, RMSNorm
from .quant import round_index
from .rope import apply_rope


class Indexer(nnx.Module):
    """``indexer.wq_b`` [H_I·d_I, R_q], ``indexer.weights_proj`` [H_I, D]; kv-and-index sources also own
    ``indexer.wk`` [d_I, d] and ``indexer.k_norm`` [d_I] (they make the index keys)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.ratio = cfg.ratio(layer)
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.topk = cfg.index_topk
        self.is_candidate_source = layer == cfg.candidate_source_layer_id and cfg.candidate_topk_blocks > 0
        self.uses_candidates = cfg.uses_candidates(layer) and cfg.candidate_topk_blocks > 0
        self.block = cfg.candidate_block_size
        self.keep_blocks = cfg.candidate_topk_blocks
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype=dtype, rngs=rngs)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, dtype=dtype, rngs=rngs)
        if layer in cfg.kv_source_layer_ids:
            self.wk = Linear(cfg.head_dim, self.head_dim, dtype=dtype, rngs=rngs)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=dtype)
        else:
            self.wk = self.k_norm = None

    def index_keys(self, latent, positions, inv_freq, rounding: bool):
        """latent f32 [B,G,d] (pre-RoPE normed compressed latent), positions [B,G] = j·r -> [B,G,d_I] f32."""
        k = self.k_norm(self.wk(latent))
        return round_index(apply_rope(k, positions, inv_freq), rounding)

    def scores(self, u, q_res, positions, keys, inv_freq, rounding: bool):
        """Index scores I [B,T,N] f32 (−∞ where not visible). u [B,T,D]; q_res [B,T,R_q]; keys [B,N,d_I]."""
        b, t = u.shape[:2]
        q = self.wq_b(q_res).reshape(b, t, self.n_heads, self.head_dim)
        q = round_index(apply_rope(q, positions[..., None], inv_freq), rounding)
        w = self.weights_proj(u).astype(jnp.float32) * self.n_heads**-0.5  # [B,T,H_I]
        s = jnp.einsum("bthd,bnd->bthn", q.astype(jnp.float32), keys.astype(jnp.float32), precision=_HIGHEST)
        s = jnp.maximum(s, 0.0) * self.head_dim**-0.5
        s = jnp.sum(s * w[..., None], axis=2)
        n_visible = (positions + 1) // self.ratio  # entry j is visible at p iff j < ⌊(p+1)/r⌋
        visible = jnp.arange(keys.shape[1])[None, None, :] < n_visible[..., None]
        return jnp.where(visible, s, -jnp.inf)

    def candidate_mask(self, scores, positions):
        """Level 1 (candidate source): keep the best K_B blocks of B_c entries per query, the newest block
        always. scores [B,T,N] -> bool [B,T,N]."""
        b, t, n = scores.shape
        n_blocks = math.ceil(n / self.block)
        padded = jnp.pad(scores, ((0, 0), (0, 0), (0, n_blocks * self.block - n)), constant_values=-jnp.inf)
        block_scores = padded.reshape(b, t, n_blocks, self.block).max(axis=-1)
        n_visible = (positions + 1) // self.ratio
        newest = jnp.where(n_visible > 0, (n_visible - 1) // self.block, -1)
        block_scores = jnp.where(jnp.arange(n_blocks) == newest[..., None], jnp.inf, block_scores)
        best, chosen = jax.lax.top_k(block_scores, min(self.keep_blocks, n_blocks))
        kept = jnp.put_along_axis(jnp.zeros((b, t, n_blocks), bool), chosen, best > -jnp.inf, axis=-1,
                                  inplace=False)
        return jnp.repeat(kept, self.block, axis=-1)[..., :n]

    def select(self, scores):
        """Top-K entries per query (K = min(index_topk, N)); a pick with score −∞ becomes −1.
        scores [B,T,N] -> int32 [B,T,K]."""
        best, chosen = jax.lax.top_k(scores, min(self.topk, scores.shape[-1]))
        return jnp.where(best > -jnp.inf, chosen, -1).astype(jnp.int32)
