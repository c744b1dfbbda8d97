"""Tensor-parallel sharding: mesh, partition rules, shard_map wrappers."""
