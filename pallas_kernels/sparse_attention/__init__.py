"""Fused sparse prefill attention (PLANNER.md §D): Pallas kernel, pure-JAX reference, public entry."""

from pallas_kernels.sparse_attention.ops import sparse_attention

__all__ = ["sparse_attention"]
