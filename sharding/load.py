"""Weights straight into their shards: each device receives only its own slice, read from the host source.

The source is a mapping (or an iterator of pairs) of model name → host array in the *real* (unpadded) shape:
the flat dict of ``checkpoint.load_checkpoint`` / ``make_tiny.random_weights``, or a lazy mapping over
memory-mapped safetensors (basic slicing then reads only the requested range). No device ever holds a whole
split tensor, and no array of the padded shape is built on the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from sharding.layout import ShardPlan, Split
from sharding.rules import param_spec, split_axis


def real_shape(name: str, padded_shape: tuple[int, ...], plan: ShardPlan) -> tuple[int, ...]:
    """The checkpoint shape of a parameter whose model (padded) shape is ``padded_shape``."""
    hit = split_axis(name, len(padded_shape), plan.layout)
    if hit is None:
        return tuple(padded_shape)
    axis, logical = hit
    out = list(padded_shape)
    out[axis] = plan.split(logical, padded_shape[axis]).total
    return tuple(out)


def place(name: str, host: Any, padded_shape: tuple[int, ...], dtype: Any, mesh: Mesh,
          plan: ShardPlan) -> jax.Array:
    """One parameter as a global ``jax.Array`` of ``padded_shape`` sharded by the rule table.

    ``host``: array-like of the real shape (numpy, memory-mapped, anything with ``shape`` and basic slicing).
    """
    expected = real_shape(name, padded_shape, plan)
    if tuple(host.shape) != expected:
        raise ValueError(f"tensor {name!r} has shape {tuple(host.shape)}, expected {expected}")
    sharding = NamedSharding(mesh, param_spec(name, len(padded_shape), plan.layout))
    hit = split_axis(name, len(padded_shape), plan.layout)
    split: Split | None = plan.split(hit[1], padded_shape[hit[0]]) if hit else None

    def shard_data(index: tuple[slice, ...]) -> np.ndarray:
        if split is None:
            return np.asarray(host[index], dtype=dtype)
        axis = hit[0]
        rank = (index[axis].start or 0) // split.shard
        return split.shard_of(host, axis, rank).astype(dtype, copy=False)

    return jax.make_array_from_callback(tuple(padded_shape), sharding, shard_data, dtype=dtype)


def place_all(source: Mapping[str, Any] | Iterable[tuple[str, Any]],
              targets: Mapping[str, jax.ShapeDtypeStruct], mesh: Mesh, plan: ShardPlan) -> dict[str, jax.Array]:
    """Every target parameter placed from ``source``; refuses missing and unexpected names.

    ``targets``: model name → padded shape and dtype (the abstract model's parameters).
    An iterator source is consumed one tensor at a time (only one host tensor alive at once).
    """
    items = source.items() if isinstance(source, Mapping) else source
    placed: dict[str, jax.Array] = {}
    unexpected = []
    for name, host in items:
        if name not in targets:
            unexpected.append(name)
            continue
        target = targets[name]
        placed[name] = place(name, host, tuple(target.shape), target.dtype, mesh, plan)
    missing = sorted(set(targets) - set(placed))
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing[:5]}{'…' if len(missing) > 5 else ''}"
                         f", unexpected {sorted(unexpected)[:5]}{'…' if len(unexpected) > 5 else ''}")
    return placed
