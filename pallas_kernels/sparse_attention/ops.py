"""Public entry: `sparse_attention` with the impl switch ("pallas" | "reference"); contract in docs/DESIGN.md.

Decode uses the same kernel: it is correct for any T (one program per (head tile, row, sequence)); at T = 1
it launches only B·⌈H/head_tile⌉ programs, which is fine for batched decode and latency-bound for a single
stream (a split-over-keys variant would be the next step there; see docs/BENCHMARKS.md).
"""

from __future__ import annotations

import jax

from pallas_kernels.sparse_attention.kernel import sparse_attention_pallas
from pallas_kernels.sparse_attention.reference import sparse_attention_reference

IMPLS = ("pallas", "reference")


def _check_shapes(q, kv_pool, topk, window, window_start, q_pos, sinks, impl, head_tile):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, Dh], got shape {q.shape}")
    batch, num_q, num_heads, head_dim = q.shape
    expected = {
        "kv_pool": (kv_pool.shape, (batch, kv_pool.shape[1] if kv_pool.ndim == 3 else -1, head_dim)),
        "topk": (topk.shape, (batch, num_q, topk.shape[-1] if topk.ndim == 3 else -1)),
        "window": (window.shape, (batch, window.shape[1] if window.ndim == 3 else -1, head_dim)),
        "window_start": (window_start.shape, (batch,)),
        "q_pos": (q_pos.shape, (batch, num_q)),
        "sinks": (sinks.shape, (num_heads,)),
    }
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ValueError(f"{name} has shape {tuple(got)}, expected {want} for q of shape {q.shape}")
    if impl == "pallas":
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError(f"the pallas kernel needs a power-of-two head dim >= 16, got {head_dim}")
        if head_tile is not None and not 1 <= head_tile <= 64:
            raise ValueError(f"head_tile must be in 1..64, got {head_tile}")


def sparse_attention(q, kv_pool, topk, window, window_start, q_pos, sinks, *, window_size: int, scale: float,
                     impl: str = "pallas", head_tile: int | None = None, interpret: bool | None = None):
    """Fused sparse attention for one layer (PLANNER.md §D, MODEL.md §B.6).

    q: [B, T, H, Dh] bf16, RoPE applied; kv_pool: [B, N, Dh] compressed entries; topk: [B, T, K] int32
    (-1 = none); window: [B, S, Dh], row i at absolute position window_start[b] + i (negative = invalid);
    window_start: [B] int32; q_pos: [B, T] int32; sinks: [H] f32.
    A query at p sees window rows at positions [max(0, p - window_size + 1), p] plus kv_pool[b, topk[b, t]];
    one float32 softmax with exp(sink_h - m) in the denominator only; V = K; duplicates kept.
    Returns o: [B, T, H, Dh] in q's dtype (no inverse RoPE); a row with no valid key gives zeros.
    head_tile: query heads per program (default min(32, H)); interpret: None = True unless running on a GPU.
    """
    _check_shapes(q, kv_pool, topk, window, window_start, q_pos, sinks, impl, head_tile)
    if impl == "reference":
        return sparse_attention_reference(q, kv_pool, topk, window, window_start, q_pos, sinks,
                                          window_size=window_size, scale=scale)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return sparse_attention_pallas(q, kv_pool, topk, window, window_start, q_pos, sinks,
                                   window_size=window_size, scale=float(scale), head_tile=head_tile,
                                   interpret=interpret)
