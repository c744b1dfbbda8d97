"""The device mesh: one axis, ``tp``, over ``world`` devices (`MODEL.md` §F.1).

Axis type: **Auto**, chosen deliberately. The model is written as plain single-device JAX (reshapes of a head
axis into groups, einsums, gathers of expert weights). Under ``Explicit`` axes every one of those ops must have a
sharding that is resolvable at trace time, and a reshape that merges a sharded dimension is an error, so the
model itself would have to be rewritten around the mesh. Under ``Auto`` the parameters carry their shardings
(``rules.py``), XLA's SPMD partitioner propagates them through the unchanged model, and the few places where the
math needs a particular layout (heads on ``tp`` in attention, the logits gathered at the end) are pinned with
``with_sharding_constraint`` (``context.constrain``, under JAX's context mesh: ``jax.set_mesh`` /
``use_abstract_mesh``). Kernels that the partitioner cannot split (Pallas calls) run
under ``jax.shard_map`` (``kernels.py``), which works the same on Auto meshes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dsv41_jax import with_flags
from dsv41_jax.planner import WORLDS

TP = "tp"


class ShardingError(ValueError):
    """A sharded run that cannot be set up; the message says what and how to fix it."""


def make_mesh(world: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D ``("tp",)`` mesh of Auto axis type over the first ``world`` devices (or ``devices``)."""
    if world not in WORLDS:
        raise ShardingError(f"world {world} is not supported: use one of {', '.join(map(str, WORLDS))}")
    available = list(devices) if devices is not None else jax.devices()
    if len(available) < world:
        raise ShardingError(
            f"world {world} needs {world} devices but only {len(available)} are visible "
            f"({available[0].platform}); on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={world} "
            f"before JAX starts")
    return jax.make_mesh((world,), (TP,), axis_types=(AxisType.Auto,), devices=available[:world])


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, PartitionSpec())


def request_host_devices(count: int) -> None:
    """Ask XLA for ``count`` simulated CPU devices; only effective before JAX initialises its backends.

    For CLIs (``generate --world N`` on a CPU machine): call before the first JAX computation.
    """
    os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""),
                                         {"xla_force_host_platform_device_count": count})
