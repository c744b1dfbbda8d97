"""A model with its weights: the one loading path (generate, serve, profile, the sharding self-check, tests).

* ``build_model(cfg, options, flat) -> Transformer``: one device, each tensor cast and placed in turn.
* ``build_sharded(run_cfg, options, flat, mesh, plan) -> Transformer``: the padded model of ``sharding.prepare``,
  each tensor placed straight into its shards (``sharding.load.place``: the rule table, and the shape check
  against the real checkpoint shape).
* ``load_weights(model, flat)``: into a model that already exists (its random init replaced).
* ``abstract_params(cfg, options)`` and ``non_params(construct, mesh)``: the pieces the builders share, also used
  by ``profiling.build`` (random weights drawn on the devices).

``flat``: model name (docs/DESIGN.md "Parameter names") → host array, or a lazily read tensor (``shape``,
``tensor[()]`` / slicing reads it, optional ``release()``; ``sharding.load.checkpoint_source``), or for the
sharded builder an iterator of (name, tensor) pairs: one tensor is read at a time, so a checkpoint never exists
whole on the host. Every builder refuses a missing or unexpected tensor by name (``WeightsError``) and a mis-shaped
one too (``WeightsError``; in the sharded builder ``place``'s ``ValueError``, which names the checkpoint shape).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sharding.load import place
from sharding.mesh import replicated

from .config import ModelConfig
from .model.transformer import Transformer, WeightsError
from .planner import kernel_tiles


def param_name(path: tuple) -> str:
    """A module-tree state path as its model name (``layers.3.attn.wq_a.weight``)."""
    return ".".join(map(str, path))


def check_names(expected: Iterable[str], given: Iterable[str]) -> None:
    """Raise ``WeightsError`` naming the first missing, then the first unexpected tensor."""
    expected, given = set(expected), set(given)
    missing, extra = sorted(expected - given), sorted(given - expected)
    if missing:
        raise WeightsError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    if extra:
        raise WeightsError(f"unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all)")


def check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise WeightsError(f"tensor {name!r} has shape {tuple(got)}, the model expects {tuple(want)}")


def abstract_params(cfg: ModelConfig, options) -> tuple[Callable[[], Transformer], Any, list, nnx.State]:
    """(construct, graphdef, [(path, abstract Param)], abstract non-parameter state) of ``Transformer(cfg,
    options)``, traced with ``nnx.eval_shape``: no random init runs."""
    def construct():
        return Transformer(cfg, options, rngs=nnx.Rngs(0))

    graphdef, params, rest = nnx.split(nnx.eval_shape(construct), nnx.Param, ...)
    return construct, graphdef, list(nnx.to_flat_state(params)), rest


def non_params(construct: Callable[[], Transformer], mesh=None) -> nnx.State:
    """The buffers that are not parameters (RoPE tables the constructor computes) from one small program,
    replicated over ``mesh`` when given. The random parameter init inside is dead code to XLA (not an output)."""
    def make():
        return nnx.split(construct(), nnx.Param, ...)[2]

    return jax.jit(make, out_shardings=None if mesh is None else replicated(mesh))()


def build_model(cfg: ModelConfig, options, flat: Mapping[str, Any]) -> Transformer:
    """A one-device ``Transformer`` holding ``flat``'s weights: parameters cast on the host and placed one at a
    time (a lazily read tensor is released after); raises ``WeightsError`` before placing anything when a
    name is missing or unexpected. ``options`` without ``tiles`` get the planner's for one device
    (``planner.kernel_tiles``), as ``sharding.prepare`` does for its world."""
    if options.tiles is None:
        options = dataclasses.replace(options, tiles=kernel_tiles(cfg, 1))
    construct, graphdef, flat_params, rest = abstract_params(cfg, options)
    check_names((param_name(path) for path, _ in flat_params), flat)
    placed = []
    for path, var in flat_params:
        name = param_name(path)
        host = flat[name]
        check_shape(name, host.shape, var.shape)
        value = np.asarray(host if isinstance(host, np.ndarray) else host[()])
        placed.append((path, var.replace(jax.device_put(value.astype(var.dtype, copy=False)))))
        del value
        if hasattr(host, "release"):
            host.release()
    if jax.tree.leaves(rest):
        rest = non_params(construct)
    return nnx.merge(graphdef, nnx.from_flat_state(placed), rest)


def build_sharded(run_cfg: ModelConfig, options, flat: Mapping[str, Any] | Iterable[tuple[str, Any]], mesh,
                  plan) -> Transformer:
    """The ``Transformer`` of the padded ``run_cfg`` (``ShardPlan.run_config``) with every parameter placed
    from ``flat`` (real checkpoint shapes) straight into its shards over ``mesh`` (``plan``: the world's
    ``sharding.ShardPlan``). An iterator is consumed one tensor at a time."""
    construct, graphdef, flat_params, _ = abstract_params(run_cfg, options)
    targets = {param_name(path): var for path, var in flat_params}
    if isinstance(flat, Mapping):
        check_names(targets, flat)  # before any tensor is read; an iterator is checked once consumed
        flat = flat.items()
    placed: dict[str, jax.Array] = {}
    unexpected = []
    for name, host in flat:
        if name not in targets:
            unexpected.append(name)
            continue
        target = targets[name]
        placed[name] = place(name, host, tuple(target.shape), target.dtype, mesh, plan)
        if hasattr(host, "release"):
            host.release()  # a lazily read tensor drops its host copy once every shard is placed
    check_names(targets, [*placed, *unexpected])
    params = nnx.from_flat_state([(path, var.replace(placed[param_name(path)])) for path, var in flat_params])
    return nnx.merge(graphdef, params, non_params(construct, mesh))


def load_weights(model: Transformer, flat: Mapping[str, np.ndarray]) -> None:
    """Set every parameter of ``model`` from ``flat``, cast to the parameter's dtype.

    Raises ``WeightsError`` naming the first missing, unexpected or mis-shaped tensor (nothing is changed then).
    """
    names = {param_name(path): var for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    check_names(names, flat)
    for name, var in names.items():
        check_shape(name, flat[name].shape, var.shape)
    for name, var in names.items():  # the Variables of the state are the model's own
        var.set_value(jnp.asarray(flat[name]).astype(var.dtype))
