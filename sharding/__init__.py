"""Tensor-parallel sharding over 1, 2, 4 or 8 devices (`MODEL.md` §F, `PLANNER.md` §C).

* ``mesh.py``: the 1-D ``tp`` mesh (Auto axes, and why).
* ``rules.py``: THE partition-rule table for every parameter and activation.
* ``layout.py``: the ``ShardPlan`` of a world (its splits are ``dsv41_jax.planner.Split``s), zero padding of
  uneven 128-block splits.
* ``load.py``: weights placed straight into their shards.
* ``prepare.py``: ``prepare(cfg, flat, world, options) -> (model, mesh)`` — the engine's entry point (admission,
  mesh, padded config; the weights through ``dsv41_jax.loading.build_sharded``).
* ``kernels.py``: ``shard_map`` wrappers of the kernel ops, their specs from the rule table.
* ``context.py``: ``activate(mesh, layout)`` (JAX's context mesh + Flax's logical-axis rules, no state of its
  own) and ``constrain(x, activation)`` for model code, active while a sharded model traces.
* ``selfcheck.py``: ``python -m sharding.selfcheck --world N`` — the sharded tiny model and the wrapped kernels
  against one device on the machine at hand.
"""

from sharding.context import activate, constrain
from sharding.layout import ShardPlan, Split
from sharding.mesh import TP, ShardingError, make_mesh, replicated, request_host_devices
from sharding.prepare import (
                              ShardedTransformer,
                              cache_sharding,
                              logits_sharding,
                              param_bytes_per_device,
                              prepare,
                              state_sharding,
)

__all__ = ["TP", "ShardPlan", "ShardedTransformer", "ShardingError", "Split", "activate", "cache_sharding",
           "constrain", "logits_sharding", "make_mesh", "param_bytes_per_device", "prepare", "replicated",
           "request_host_devices", "state_sharding"]
