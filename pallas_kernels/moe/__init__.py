"""Routed-expert MoE (the x3gm block, PLANNER.md §E): Pallas kernel, pure-JAX reference, grouping."""

from pallas_kernels.moe.ops import ExpertWeights, routed_experts

__all__ = ["ExpertWeights", "routed_experts"]
