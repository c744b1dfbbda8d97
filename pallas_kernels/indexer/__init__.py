"""The indexer's scores fused with its top-k (MODEL.md §B.8): Pallas kernel, XLA implementation, public entry."""

from pallas_kernels.indexer.ops import index_topk

__all__ = ["index_topk"]
