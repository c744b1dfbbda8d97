"""Lightning indexer with candidate blocks (`MODEL.md` §B.8): per query, the top-k compressed entries."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import ModelConfig
from .norms import HIGHEST, Linear, RMSNorm
from .quant import round_index
from .rope import apply_rope


class Indexer(nnx.Module):
    """``indexer.wq_b`` [H_I·d_I, R_q], ``indexer.weights_proj`` [H_I, D]; kv-and-index sources also own
    ``indexer.wk`` [d_I, d] and ``indexer.k_norm`` [d_I] (they make the index keys)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.ratio = cfg.ratio(layer)
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.index_topk = cfg.index_topk
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

    def topk(self, u, q_res, positions, keys, inv_freq, rounding: bool, kept_blocks=None):
        """Top-K entries of ``keys`` per query (−1 = none) and, for the candidate source, its kept blocks.

        u [B,T,D]; q_res [B,T,R_q]; positions [B,T]; keys [B,N,d_I]; kept_blocks bool [B,T,⌈N/B_c⌉] (the
        candidate source's, for a candidate-masked layer). Returns (int32 [B,T,K], kept_blocks | None).
        Scores are formed in blocks of query rows so that [rows, H_I, N] stays within SCORE_BUDGET_BYTES.
        """
        b, t = u.shape[:2]
        q = self.wq_b(q_res).reshape(b, t, self.n_heads, self.head_dim)
        q = round_index(apply_rope(q, positions[..., None], inv_freq), rounding)
        w = self.weights_proj(u).astype(jnp.float32) * self.n_heads**-0.5  # [B,T,H_I]
        keys = keys.astype(jnp.float32)
        n = keys.shape[1]

        def rows(q, w, positions, kept):
            s = self.scores(q, w, positions, keys)
            new_kept = None
            if self.is_candidate_source:
                new_kept = self.candidate_blocks(s, positions)
            elif self.uses_candidates:
                s = jnp.where(jnp.repeat(kept, self.block, axis=-1)[..., :n], s, -jnp.inf)
            return self.select(s), new_kept

        if kept_blocks is None:
            kept_blocks = jnp.zeros((b, t, 0), bool)
        block = rows_per_block(t, 4 * n * (self.n_heads + 2))
        return map_row_blocks(rows, (q, w, positions, kept_blocks), block)

    def scores(self, q, w, positions, keys):
        """I [B,T,N] f32 (−∞ where not visible): Σ_h w[h] · ReLU(q_h · k) · d_I^(−1/2).
        q [B,T,H_I,d_I] (roped, rounded); w f32 [B,T,H_I] (already × H_I^(−1/2)); keys f32 [B,N,d_I]."""
        s = jnp.einsum("bthd,bnd->bthn", q.astype(jnp.float32), keys, precision=HIGHEST)
        s = jnp.maximum(s, 0.0) * self.head_dim**-0.5
        s = jnp.sum(s * w[..., None], axis=2)
        n_visible = (positions + 1) // self.ratio  # entry j is visible at p iff j < ⌊(p+1)/r⌋
        visible = jnp.arange(keys.shape[1])[None, None, :] < n_visible[..., None]
        return jnp.where(visible, s, -jnp.inf)

    def candidate_blocks(self, scores, positions):
        """Level 1 (candidate source): keep the best K_B blocks of B_c entries per query, the newest block
        always; a kept block whose score is −∞ is dropped. scores [B,T,N] -> bool [B,T,⌈N/B_c⌉]."""
        b, t, n = scores.shape
        n_blocks = math.ceil(n / self.block)
        padded = jnp.pad(scores, ((0, 0), (0, 0), (0, n_blocks * self.block - n)), constant_values=-jnp.inf)
        block_scores = padded.reshape(b, t, n_blocks, self.block).max(axis=-1)
        n_visible = (positions + 1) // self.ratio
        newest = jnp.where(n_visible > 0, (n_visible - 1) // self.block, -1)
        block_scores = jnp.where(jnp.arange(n_blocks) == newest[..., None], jnp.inf, block_scores)
        best, chosen = jax.lax.top_k(block_scores, min(self.keep_blocks, n_blocks))
        return jnp.put_along_axis(jnp.zeros((b, t, n_blocks), bool), chosen, best > -jnp.inf, axis=-1,
                                  inplace=False)

    def select(self, scores):
        """Top-K entries per query (K = min(index_topk, N)); a pick with score −∞ becomes −1.
        scores [B,T,N] -> int32 [B,T,K]."""
        best, chosen = jax.lax.top_k(scores, min(self.index_topk, scores.shape[-1]))
        return jnp.where(best > -jnp.inf, chosen, -1).astype(jnp.int32)


SCORE_BUDGET_BYTES = 256 << 20  # scratch for one block of query rows (score matrices, gathered keys)


def rows_per_block(t: int, bytes_per_row: int, budget: int | None = None) -> int:
    """Query rows per block so that a block's scratch stays within ``budget`` (default SCORE_BUDGET_BYTES;
    all T rows if they fit)."""
    budget = SCORE_BUDGET_BYTES if budget is None else budget
    if t * bytes_per_row <= budget:
        return t
    return max(1, min(t, budget // bytes_per_row))


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
