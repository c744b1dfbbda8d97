"""Fused sparse attention (PLANNER.md §D): ops (public entry), xla and Pallas implementations, the gather oracle
for the tests (``reference.py``)."""

from pallas_kernels.sparse_attention.ops import sparse_attention

__all__ = ["sparse_attention"]
