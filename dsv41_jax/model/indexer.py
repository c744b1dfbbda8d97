"""Lightning indexer with candidate blocks (`MODEL.md` §B.8): per query, the top-k compressed entries."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from pallas_kernels.indexer.ops import index_topk
from pallas_kernels.indexer.tiling import launch_rows
from sharding.kernels import index_topk as sharded_index_topk  # replicated shard_map when sharded

from ..config import ModelConfig
from ..planner import INDEX_BUDGET, KernelTiles
from .dense import Dense
from .norms import Linear, RMSNorm
from .quant import round_gemm_input, round_index
from .rope import apply_rope


class Indexer(nnx.Module):
    """``indexer.wq_b`` [H_I·d_I, R_q], ``indexer.weights_proj`` [H_I, D]; kv-and-index sources also own
    ``indexer.wk`` [d_I, d] and ``indexer.k_norm`` [d_I] (they make the index keys)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs, impl: str = "xla",
                 tiles: KernelTiles | None = None, dense: Dense = Dense(), gemm_inputs: str = "exact"):
        self.impl = impl  # "xla" (row-blocked scores) | "pallas" (fused kernel)
        self.gemm_inputs = gemm_inputs  # "fp8": wq_b's input rounded (quant.round_gemm_input); weights_proj's not
        # the kernel's scratch a launch of query rows (B_idx, §B-3): the plan's, else the planner's default
        self.kernel_budget = SCORE_BUDGET_BYTES if tiles is None else tiles.index_budget
        self.ratio = cfg.ratio(layer)
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.index_topk = cfg.index_topk
        self.is_candidate_source = layer == cfg.candidate_source_layer_id and cfg.candidate_topk_blocks > 0
        self.uses_candidates = cfg.uses_candidates(layer) and cfg.candidate_topk_blocks > 0
        self.block = cfg.candidate_block_size
        self.keep_blocks = cfg.candidate_topk_blocks
        self.wq_b = dense.linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype=dtype, rngs=rngs,
                                 rule="layers.0.attn.indexer.wq_b")
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

    def topk(self, u, q_res, positions, keys, inv_freq, rounding: bool, kept_blocks=None, row=None):
        """Top-K entries of ``keys`` per query (−1 = none) and, for the candidate source, its kept blocks.

        u [B,T,D]; q_res [B,T,R_q]; positions [B,T]; keys [B,N,d_I]; kept_blocks bool [B,T,⌈N/B_c⌉] (the
        candidate source's, for a candidate-masked layer); ``row``: as ``Attention.__call__``'s. Returns
        (int32 [B,T,K], kept_blocks | None).
        Scores and selection: ``pallas_kernels.indexer`` (``impl``; see ``XLA_DECODE_ROWS``), over blocks of
        query rows: the XLA path's [rows, H_I, N] scores, the kernel's workspace (``tiling.launch_rows``) within
        SCORE_BUDGET_BYTES.
        """
        b, t = u.shape[:2]
        q = self.wq_b(round_gemm_input(q_res, self.gemm_inputs), row).reshape(b, t, self.n_heads, self.head_dim)
        q = round_index(apply_rope(q, positions[..., None], inv_freq), rounding)
        if rounding:  # fp4-grid values (§C.2) are exact in the keys' dtype: the XLA path's product stays in it
            q = q.astype(keys.dtype)
        w = self.weights_proj(u).astype(jnp.float32) * self.n_heads**-0.5  # [B,T,H_I]
        kw = dict(ratio=self.ratio, k=self.index_topk, block_size=self.block,
                  keep_blocks=self.keep_blocks if self.is_candidate_source else 0)
        kept_blocks = kept_blocks if self.uses_candidates else None
        if self.impl == "pallas" and t > XLA_DECODE_ROWS:
            block = launch_rows(b, t, keys.shape[1], self.index_topk, budget=self.kernel_budget,
                                heads=self.n_heads, head_dim=self.head_dim, keep_blocks=kw["keep_blocks"],
                                block_size=self.block, masked=kept_blocks is not None)
            return sharded_index_topk(q, w, keys, positions, kept_blocks, **kw, impl="pallas", rows_per_block=block)
        block = rows_per_block(t, 4 * keys.shape[1] * (self.n_heads + 2))
        return index_topk(q, w, keys, positions, kept_blocks, **kw, impl="xla", rows_per_block=block)


# Launches of at most this many rows a sequence select on the XLA path even with indexer_impl="pallas" (0: none).
# Both select the same entries (one tie rule), so the choice is speed only: the kernel (one row a program) is the
# faster one in the decode step (measured: see docs/BENCHMARKS.md, section "Indexer: decode rows one row a
# program").
XLA_DECODE_ROWS = 0
SCORE_BUDGET_BYTES = INDEX_BUDGET  # scratch for one block of query rows (score matrices, gathered keys)


def rows_per_block(t: int, bytes_per_row: int, budget: int | None = None) -> int:
    """Query rows per block so that a block's scratch stays within ``budget`` (default SCORE_BUDGET_BYTES;
    all T rows if they fit)."""
    budget = SCORE_BUDGET_BYTES if budget is None else budget
    if t * bytes_per_row <= budget:
        return t
    return max(1, min(t, budget // bytes_per_row))
