"""The indexer's scores fused with its top-k (MODEL.md §B.8): ops (public entry), xla and Pallas implementations,
the kernel's tiling (pure Python).

``index_topk`` is imported lazily so that ``pallas_kernels.indexer.tiling`` (pure Python) serves the planner
without importing JAX."""

__all__ = ["index_topk"]


def __getattr__(name: str):
    if name == "index_topk":
        from pallas_kernels.indexer.ops import index_topk  # noqa: PLC0415 - JAX only when the op is asked for
        return index_topk
    raise AttributeError(f"module 'pallas_kernels.indexer' has no attribute {name!r}")
