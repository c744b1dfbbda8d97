"""Routed-expert MoE (the x3gm block, PLANNER.md §E): ops (public entry), xla and Pallas implementations, the
kernel's tile grouping, the gather oracle for the tests (``reference.py``), the lowering's addressing limit
(``addressing.py``, pure Python).

``ExpertWeights`` and ``routed_experts`` are imported lazily so that ``pallas_kernels.moe.addressing`` serves the
planner without importing JAX."""

__all__ = ["ExpertWeights", "routed_experts"]


def __getattr__(name: str):
    if name in __all__:
        from pallas_kernels.moe import ops
        return getattr(ops, name)
    raise AttributeError(f"module 'pallas_kernels.moe' has no attribute {name!r}")
