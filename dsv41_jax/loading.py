"""A model with its weights: the one loading path (generate, serve, profile, the sharding self-check, tests).

* ``build_model(cfg, options, flat) -> Transformer``: one device, each tensor cast and placed in turn.
* ``build_sharded(run_cfg, options, flat, mesh, plan) -> Transformer``: the padded model of ``sharding.prepare``,
  each tensor placed straight into its shards (``sharding.load.place``: the rule table, and the shape check
  against the real checkpoint shape).
* ``load_weights(model, flat)``: into a model that already exists (its random init replaced).
* ``abstract_params(cfg, options)`` and ``non_params(construct, rest, mesh)``: the pieces the builders
  share, also used by ``profiling.build`` (random weights drawn on the devices).

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

from sharding.layout import check_fp8_blocks
from sharding.load import place
from sharding.mesh import replicated

from .config import ModelConfig
from .model.transformer import Transformer, WeightsError
from .param_specs import layer_names
from .planner import kernel_tiles

DENSE_FORMAT_CHOICES = ("auto", "bf16", "dequantized", "fp8")


def choose_dense_format(requested: str, stored: str) -> str:
    """``ModelOptions.dense_format`` for a run: ``requested`` "fp8" (the dense matrices held as stored: the
    checkpoint must store them in fp8, ``stored``: `checkpoint.Checkpoint.stored_dense_format`, "dequantized"
    for random weights), "bf16" / "dequantized" (in the model dtype), or "auto": dequantised. fp8 is asked for,
    not chosen: it halves the dense weights' bytes, but its kernel is not yet faster than the bf16 dot at
    decode sizes (docs/BENCHMARKS.md). ValueError (one line, for the user) when fp8 is asked of weights not
    stored so."""
    if requested not in DENSE_FORMAT_CHOICES:
        raise ValueError(f"dense format {requested!r} must be one of {', '.join(DENSE_FORMAT_CHOICES)}")
    if requested == "fp8" and stored != "fp8":
        raise ValueError("dense format fp8 holds the dense weights as the checkpoint stores them: it needs a "
                         "checkpoint whose dense matrices are stored in fp8 (these weights are not)")
    return "fp8" if requested == "fp8" else "dequantized"


def param_name(path: tuple) -> str:
    """A module-tree state path as its model name (``layers.3.attn.wq_a.weight``; a stacked run's
    ``layers.3-7.attn.wq_a.weight`` holds the per-layer tensors ``layer_names`` lists, stacked on axis 0)."""
    return ".".join(map(str, path))


class StackedHost:
    """The per-layer host tensors of a stacked parameter as one array-like ``[n, ...]`` (``shape``, basic
    slicing, ``release``): a slice reads only the layers and rows it asks for, so ``place`` builds each
    device's shard without the stacked tensor existing whole on the host."""

    def __init__(self, name: str, parts: list):
        shapes = {tuple(p.shape) for p in parts}
        if len(shapes) != 1:
            raise WeightsError(f"the layers of {name!r} have different shapes {sorted(shapes)}")
        self.parts = parts
        self.shape = (len(parts), *shapes.pop())

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis for i in index):
            index = ()
        head, rest = (index[0], index[1:]) if index else (slice(None), ())
        rows = range(len(self.parts))[head]
        read = [np.asarray(self.parts[r][rest] if rest else self.parts[r][()]) for r in
                ([rows] if isinstance(rows, int) else rows)]
        return read[0] if isinstance(rows, int) else np.stack(read)

    def release(self) -> None:
        for part in self.parts:
            if hasattr(part, "release"):
                part.release()


def _per_layer(names: Iterable[str]) -> list[str]:
    return [n for name in names for n in layer_names(name)]


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


class _OneKey:
    """Stands in for ``nnx.Rngs`` where only shapes matter: every draw takes the same key. ``nnx.Rngs`` counts
    its draws in a Variable, and under ``eval_shape`` each count update makes JAX format an error message that
    walks the whole trace so far (flax's ``set_value`` probes ``.sharding`` on a tracer): quadratic in the
    parameters, 6.8 s of the 40-layer model's construction on a CPU host."""

    def params(self):
        return jax.random.key(0)


def abstract_params(cfg: ModelConfig, options) -> tuple[Callable[[], Transformer], Any, list, nnx.State]:
    """(construct, graphdef, [(path, abstract Param)], abstract non-parameter state) of ``Transformer(cfg,
    options)``, traced with ``nnx.eval_shape``: no random init runs."""
    def construct():
        return Transformer(cfg, options, rngs=_OneKey())

    graphdef, params, rest = nnx.split(nnx.eval_shape(construct), nnx.Param, ...)
    return construct, graphdef, list(nnx.to_flat_state(params)), rest


def non_params(construct: Callable[[], Transformer], rest: nnx.State, mesh=None) -> nnx.State:
    """The buffers that are not parameters (RoPE tables the constructor computes) from one small program,
    replicated over ``mesh`` when given; ``rest`` itself when the abstract ``rest`` (``abstract_params``) has
    none, as no config today does (tracing the constructor again costs ~6 s for the 40-layer model on a CPU
    host). The random parameter init inside is dead code to XLA (not an output)."""
    if not jax.tree.leaves(rest):
        return rest

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
    check_names(_per_layer(param_name(path) for path, _ in flat_params), flat)
    placed = []
    for path, var in flat_params:
        name = param_name(path)
        host = _host(name, flat, var.shape)
        value = np.asarray(host if isinstance(host, np.ndarray) else host[()])
        placed.append((path, var.replace(jax.device_put(value.astype(var.dtype, copy=False)))))
        del value
        if hasattr(host, "release"):
            host.release()
    return nnx.merge(graphdef, nnx.from_flat_state(placed), non_params(construct, rest))


def _host(name: str, flat: Mapping[str, Any], shape: tuple[int, ...]):
    """The host tensor(s) of model parameter ``name`` from ``flat`` (per-layer names), shape-checked."""
    parts = layer_names(name)
    if len(parts) == 1:
        check_shape(name, flat[name].shape, shape)
        return flat[name]
    for part in parts:
        check_shape(part, flat[part].shape, shape[1:])
    return StackedHost(name, [flat[part] for part in parts])


def build_sharded(run_cfg: ModelConfig, options, flat: Mapping[str, Any] | Iterable[tuple[str, Any]], mesh,
                  plan) -> Transformer:
    """The ``Transformer`` of the padded ``run_cfg`` (``ShardPlan.run_config``) with every parameter placed
    from ``flat`` (real checkpoint shapes) straight into its shards over ``mesh`` (``plan``: the world's
    ``sharding.ShardPlan``). An iterator is consumed one tensor at a time."""
    construct, graphdef, flat_params, rest = abstract_params(run_cfg, options)
    targets = {param_name(path): var for path, var in flat_params}
    check_fp8_blocks(plan, {name: tuple(var.shape) for name, var in targets.items()})  # before any tensor is read
    owner = {part: (name, i) for name in targets for i, part in enumerate(layer_names(name))}
    if isinstance(flat, Mapping):
        check_names(owner, flat)  # before any tensor is read; an iterator is checked once consumed
        flat = flat.items()
    placed: dict[str, jax.Array] = {}
    gathering: dict[str, list] = {}  # a stacked parameter's per-layer tensors until its last layer arrives
    unexpected = []
    for part, host in flat:
        if part not in owner:
            unexpected.append(part)
            continue
        name, i = owner[part]
        n = len(layer_names(name))
        if n > 1:
            parts = gathering.setdefault(name, [None] * n)
            parts[i] = host
            if any(p is None for p in parts):
                continue
            host = StackedHost(name, gathering.pop(name))
        target = targets[name]
        placed[name] = place(name, host, tuple(target.shape), target.dtype, mesh, plan)
        if hasattr(host, "release"):
            host.release()  # a lazily read tensor drops its host copy once every shard is placed
    given = [*_per_layer(placed), *(layer_names(n)[i] for n, ps in gathering.items()
                                    for i, p in enumerate(ps) if p is not None)]
    check_names(owner, [*given, *unexpected])
    params = nnx.from_flat_state([(path, var.replace(placed[param_name(path)])) for path, var in flat_params])
    return nnx.merge(graphdef, params, non_params(construct, rest, mesh))


def load_weights(model: Transformer, flat: Mapping[str, np.ndarray]) -> None:
    """Set every parameter of ``model`` from ``flat``, cast to the parameter's dtype.

    Raises ``WeightsError`` naming the first missing, unexpected or mis-shaped tensor (nothing is changed then).
    """
    names = {param_name(path): var for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    check_names(_per_layer(names), flat)
    hosts = {name: _host(name, flat, var.shape) for name, var in names.items()}
    for name, var in names.items():  # the Variables of the state are the model's own
        var.set_value(jnp.asarray(np.asarray(hosts[name][()])).astype(var.dtype))
