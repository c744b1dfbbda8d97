"""Public entry: ``index_topk`` (the indexer's scores fused with its top-k, MODEL.md §B.8), one signature over the
registry's implementations ("xla" | "pallas", ``pallas_kernels.registry``); contract in docs/DESIGN.md."""

from __future__ import annotations

import jax
from jax import lax

from pallas_kernels import registry
from pallas_kernels.indexer.kernel import fp8_exact, index_topk_pallas
from pallas_kernels.indexer.xla import index_topk_xla
from pallas_kernels.row_blocks import map_row_blocks

IMPLS = registry.IMPLEMENTATIONS
SCORE_DTYPES = ("bfloat16", "float8_e4m3fn")


def _check(q, w, keys, positions, kept_blocks, keep_blocks, block_size, impl, score_dtype):
    if score_dtype not in SCORE_DTYPES:
        raise ValueError(f"score_dtype must be one of {SCORE_DTYPES}, got {score_dtype!r}")
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, d], got shape {q.shape}")
    b, t, h, d = q.shape
    n = keys.shape[1] if keys.ndim == 3 else -1
    want = {"w": (w.shape, (b, t, h)), "keys": (keys.shape, (b, n, d)), "positions": (positions.shape, (b, t))}
    if kept_blocks is not None:
        want["kept_blocks"] = (kept_blocks.shape, (b, t, -(-n // block_size)))
    for name, (got, expected) in want.items():
        if tuple(got) != expected:
            raise ValueError(f"{name} has shape {tuple(got)}, expected {expected} for q of shape {q.shape}")
    if kept_blocks is not None and keep_blocks:
        raise ValueError("a layer is either the candidate source (keep_blocks > 0) or candidate-masked "
                         "(kept_blocks), not both")
    if impl == "pallas" and (d < 16 or d & (d - 1)):
        raise ValueError(f"the pallas indexer needs a power-of-two head dim >= 16, got {d}")


def index_topk(q, w, keys, positions, kept_blocks=None, *, ratio: int, k: int, keep_blocks: int = 0,
               block_size: int = 1, impl: str = "pallas", rows_per_block: int | None = None,
               score_dtype: str = "bfloat16", interpret: bool | None = None, **tiling):
    """Per query row, the top-K (K = min(k, N)) index keys by the indexer score (MODEL.md §B.8–B.9).

    q [B,T,H,d] (roped, fp4-rounded; H index heads); w f32 [B,T,H] (weights_proj output × H^(−1/2));
    keys [B,N,d] index keys; positions [B,T] int32: entry j is visible at p iff j < ⌊(p+1)/ratio⌋.
    score I[t,j] = Σ_h w[t,h] · ReLU(q[t,h] · keys[j]) · d^(−1/2), −∞ where not visible.
    kept_blocks bool [B,T,⌈N/block_size⌉] (reindex layers): entries of dropped blocks score −∞.
    keep_blocks > 0 (the candidate source): also return its level-1 candidate blocks.

    Returns (int32 [B,T,K] picks in no particular order, −1 where the pick's score is −∞;
    bool [B,T,⌈N/block_size⌉] kept blocks or None). Tie rule (both impls): among equal scores the lower
    entry index is selected. Both impls work over blocks of ``rows_per_block`` query rows (default all):
    "xla" (the block's [rows, H, N] scores exist), "pallas" = the fused kernel, one launch per
    block (no score matrix; ``tiling.launch_rows`` sizes a block to a workspace budget), ``score_dtype`` of its
    MMA inputs (e4m3 runs only when q and keys are exact in it, else bf16; launches of few rows score in
    bf16); interpret: None = True unless running on a GPU; ``tiling``: block_rows, key_tile, group, splits,
    num_warps, num_stages (tiling.tiling).
    """
    impl = registry.resolve(impl)  # "reference": the deprecated name of "xla"
    _check(q, w, keys, positions, kept_blocks, keep_blocks, block_size, impl, score_dtype)
    kw = dict(ratio=ratio, k=k, keep_blocks=keep_blocks, block_size=block_size)
    if impl == "xla":
        return index_topk_xla(q, w, keys, positions, kept_blocks=kept_blocks, rows_per_block=rows_per_block,
                              **kw)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    def launch(dtype, q, w, positions, *kept):
        return index_topk_pallas(q, w, keys, positions, *kept, **kw, score_dtype=dtype, interpret=interpret,
                                 **tiling)

    def run(dtype):
        rows = (q, w, positions) + (() if kept_blocks is None else (kept_blocks,))
        return map_row_blocks(lambda *r: launch(dtype, *r), rows, rows_per_block or q.shape[1])

    if score_dtype == "bfloat16" or keys.shape[1] == 0:
        return run("bfloat16")
    return lax.cond(fp8_exact(q, keys), lambda: run(score_dtype), lambda: run("bfloat16"))
