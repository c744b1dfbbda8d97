"""Routed-expert MoE (the x3gm block, PLANNER.md §E): ops (public entry), xla and Pallas implementations, the
kernel's tile grouping, the gather oracle for the tests (``reference.py``)."""

from pallas_kernels.moe.ops import ExpertWeights, routed_experts

__all__ = ["ExpertWeights", "routed_experts"]
