"""Public entry: ``sparse_attention``, one signature over the registry's implementations ("xla" | "pallas",
``pallas_kernels.registry``); contract in docs/DESIGN.md. The gather ``reference.py`` is the tests' oracle only.

Decode uses the same kernel: it is correct for any T (one program per (head tile, row, sequence)). A launch of
at most 8 rows (decode) also splits each row's key tiles over programs, one a tile (``kernel.key_splits``), and
joins their softmax states after (flash-decoding): one program per head tile walking a decode row's ~10 key tiles
alone is latency-bound (measured: see docs/BENCHMARKS.md, section "Decode attention split over keys; select kernel
that stops early").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels.sparse_attention.kernel import sparse_attention_pallas
from pallas_kernels.sparse_attention.xla import scratch_bytes_per_row, sparse_attention_xla

__all__ = ["IMPLS", "scratch_bytes_per_row", "sparse_attention"]  # scratch_bytes_per_row: the model's row blocks

IMPLS = registry.IMPLEMENTATIONS


def _check_shapes(q, kv_pool, topk, window, window_start, q_pos, sinks, impl, head_tile):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, Dh], got shape {q.shape}")
    batch, num_q, num_heads, head_dim = q.shape
    expected = {
        "window": (window.shape, (batch, window.shape[1] if window.ndim == 3 else -1, head_dim)),
        "window_start": (window_start.shape, (batch,)),
        "q_pos": (q_pos.shape, (batch, num_q)),
        "sinks": (sinks.shape, (num_heads,)),
    }
    if kv_pool is not None:
        expected["kv_pool"] = (kv_pool.shape, (batch, kv_pool.shape[1] if kv_pool.ndim == 3 else -1, head_dim))
    if topk is not None:
        expected["topk"] = (topk.shape, (batch, num_q, topk.shape[-1] if topk.ndim == 3 else -1))
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ValueError(f"{name} has shape {tuple(got)}, expected {want} for q of shape {q.shape}")
    if (kv_pool is None) != (topk is None):
        raise ValueError("kv_pool and topk are given together or both None (a window-only layer)")
    if impl == "pallas":
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError(f"the pallas kernel needs a power-of-two head dim >= 16, got {head_dim}")
        if head_tile is not None and not 1 <= head_tile <= 64:
            raise ValueError(f"head_tile must be in 1..64, got {head_tile}")


def sparse_attention(q, kv_pool, topk, window, window_start, q_pos, sinks, *, window_size: int, scale: float,
                     impl: str = "pallas", rows_per_block: int | None = None, head_tile: int | None = None,
                     interpret: bool | None = None):
    """Fused sparse attention for one layer (PLANNER.md §D, MODEL.md §B.6).

    q: [B, T, H, Dh], RoPE applied; kv_pool: [B, N, Dh] compressed entries; topk: [B, T, K] int32
    (-1 = none); kv_pool and topk both None: a window-only layer; window: [B, S, Dh], row i at absolute
    position window_start[b] + i (negative = invalid); window_start: [B] int32; q_pos: [B, T] int32; sinks: [H] f32.
    A query at p sees window rows at positions [max(0, p - window_size + 1), p] plus kv_pool[b, topk[b, t]];
    one float32 softmax with exp(sink_h - m) in the denominator only; V = K; duplicates kept.
    Returns o: [B, T, H, Dh] in q's dtype (no inverse RoPE); a row with no valid key gives zeros.
    impl: "xla" (f32 scores over blocks of ``rows_per_block`` query rows, default all) or "pallas" (the kernel:
    keys in q's dtype, ``head_tile`` query heads per program, default min(32, H); interpret: None = True unless
    running on a GPU). "reference" is a deprecated name of "xla" (``registry``).
    """
    impl = registry.resolve(impl)
    _check_shapes(q, kv_pool, topk, window, window_start, q_pos, sinks, impl, head_tile)
    if impl == "xla":
        return sparse_attention_xla(q, kv_pool, topk, window, window_start, q_pos, sinks,
                                    window_size=window_size, scale=scale, rows_per_block=rows_per_block)
    if kv_pool is None:  # window-only layer: the kernel takes one empty pick of a one-row pool
        kv_pool = jnp.zeros((q.shape[0], 1, q.shape[-1]), q.dtype)
        topk = jnp.full((*q.shape[:2], 1), -1, jnp.int32)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    # The kernel takes keys in q's dtype. Lossless with the model's rounding points on (fp8 / fp4 grid values are
    # exact in bf16); with them off, f32 compressed entries are rounded to bf16 here.
    return sparse_attention_pallas(q, kv_pool.astype(q.dtype), topk, window.astype(q.dtype), window_start, q_pos,
                                   sinks, window_size=window_size, scale=float(scale), head_tile=head_tile,
                                   interpret=interpret)
