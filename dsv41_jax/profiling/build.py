"""Random weights and a filled cache made on the devices, already sharded (no host copy of the model).

Weights: the model is built abstractly (``nnx.eval_shape``); one jitted program then draws every parameter,
its ``out_shardings`` the parameters' ``NamedSharding``s from the rule table (``sharding.rules``). The values
come from a counter hash of each element's index (elementwise over iotas), so the SPMD partitioner gives each
device only its own shard to compute. Scales follow ``make_tiny`` (linear weights of std 1/√fan_in, norms
1 ± 0.1, small HC mixes) so activations stay O(1); the distribution is uniform, not normal. The model is the
``sharding.ShardedTransformer`` that ``sharding.prepare`` makes, with the padded run config.

Cache: ``init_cache`` sized ``position + rows`` per sequence, every array filled with random values (window
rings, compressed entries, index keys, pending rows) and ``offset = position``: a step at that position does
the work of a real one (all ``⌊position/r⌋`` entries visible to the indexer and the attention).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from dsv41_jax.config import ModelConfig
from dsv41_jax.loading import abstract_params, non_params, param_name
from dsv41_jax.model import ModelOptions, init_cache
from dsv41_jax.planner import admit, kernel_tiles
from sharding import ShardedTransformer, make_mesh, replicated
from sharding.layout import ShardPlan
from sharding.rules import param_spec


def build_model(cfg: ModelConfig, world: int, options: ModelOptions, *, seed: int = 0, layout: str = "tp",
                abstract: bool = False) -> tuple[ShardedTransformer, Mesh]:
    """A ``ShardedTransformer`` over the first ``world`` devices with random, sharded parameters.

    ``abstract``: no arrays at all — every parameter is a ``jax.ShapeDtypeStruct`` carrying its sharding, enough
    to lower and compile the steps (``--compile-only``: XLA's analyses of models that do not fit).
    """
    plan = ShardPlan.from_admission(cfg, world, admit(cfg, world), layout)
    if options.tiles is None:  # the plan's kernel tiles, as sharding.prepare gives a loaded model
        options = dataclasses.replace(options, tiles=kernel_tiles(cfg, world))
    mesh = make_mesh(world)
    run_cfg = plan.run_config(cfg)
    construct, graphdef, flat, rest = abstract_params(run_cfg, options)
    names = [param_name(path) for path, _ in flat]
    shardings = [NamedSharding(mesh, param_spec(n, len(v.shape), layout)) for n, (_, v) in zip(names, flat)]
    specs = [(zlib.crc32(n.encode()) ^ seed, tuple(v.shape), jnp.dtype(v.dtype),
              *_scale(n, v.shape, jnp.dtype(v.dtype))) for n, (_, v) in zip(names, flat)]
    if abstract:
        arrays = [jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh) for (_, v), sh in zip(flat, shardings)]
        rest = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated(mesh)), rest)
    else:
        arrays = jax.jit(functools.partial(_draw_all, specs), out_shardings=shardings)()
        rest = non_params(construct, rest, mesh)
    drawn = nnx.from_flat_state([(path, var.replace(a)) for (path, var), a in zip(flat, arrays)])
    inner = nnx.merge(graphdef, drawn, rest)
    return ShardedTransformer(inner, mesh, plan, cfg, run_cfg), mesh


FP8_CODE_STD = 64.0  # fp8 dense codes' spread (well inside e4m3's ±448), as Fp8Linear's own init


def _scale(name: str, shape: tuple[int, ...], dtype=None) -> tuple[float, float | None]:
    """(mean, std) of a parameter, as ``make_tiny.random_weights`` draws it. Stored formats: fp4 expert ``codes``
    get std None (random bytes); fp8 dense codes (float8_e4m3fn) std ``FP8_CODE_STD``; the ue8m0 scale bytes
    (fp4 ``scales``, fp8 ``.scale``) get, in place of a std, the scale that makes the decoded weights' spread
    1/√fan_in (fan_in = 32 · the scales' last axis): e2m1 codes spread about 2, fp8 ones ``FP8_CODE_STD``."""
    if name.endswith(".codes"):
        return 0.0, None
    if dtype == jnp.float8_e4m3fn:
        return 0.0, FP8_CODE_STD
    if name.endswith(".scales"):
        return 0.0, 1.0 / (2.0 * math.sqrt(32 * shape[-1]))
    if name.endswith(".scale") and dtype == jnp.uint8:
        return 0.0, 1.0 / (FP8_CODE_STD * math.sqrt(32 * shape[-1]))
    if name.endswith("embed.weight"):
        return 0.0, 1.0
    if name.endswith("norm.weight"):
        return 1.0, 0.1
    if name.endswith("_fn"):
        return 0.0, 0.3 / math.sqrt(shape[-1])
    if name.endswith("_base"):
        return 0.0, 0.2
    if name.endswith("_scale"):
        return 1.0, 0.3
    if name.endswith(".attn_sink"):
        return 0.0, 0.1
    if name.endswith(".gate.bias"):
        return 0.0, 0.05
    return 0.0, 1.0 / math.sqrt(shape[-1])


def _draw_all(specs) -> list[jax.Array]:
    """One program drawing every parameter: mean + std·U, U uniform with unit variance, in the parameter's dtype;
    the uint8 bytes of stored formats (fp4 experts' ``codes`` / ``scales``, fp8 dense ``.scale``) as ``_draw_packed``.

    A counter hash (``_hash_uniform``), not threefry: it compiles in well under a second for hundreds of
    tensors (threefry took ~50 s on CPU for the tiny model) and, being elementwise over iotas, each device
    computes only its own shard. The values only need to be finite and of the right scale for profiling.
    """
    out = []
    for salt, shape, dtype, mean, std in specs:
        if dtype == jnp.uint8:
            out.append(_draw_packed(shape, salt, std))
            continue
        u = _hash_uniform(shape, salt)  # f32 [shape] in [0, 1)
        out.append((mean + std * math.sqrt(3.0) * (2.0 * u - 1.0)).astype(dtype))
    return out


def _draw_packed(shape: tuple[int, ...], salt: int, scale: float | None) -> jax.Array:
    """Bytes of the stored formats (MODEL.md §E.1): fp4 ``codes`` (``scale`` None) are uniform random bytes, two
    e2m1 values each; a ue8m0 scale tensor is one constant byte, 2^(byte − 127) ≈ ``scale`` (see `_scale`)."""
    if scale is None:
        return (_hash_uniform(shape, salt) * 256.0).astype(jnp.uint8)
    return jnp.full(shape, 127 + round(math.log2(scale)), jnp.uint8)


def _hash_uniform(shape: tuple[int, ...], salt: int) -> jax.Array:
    """f32 uniform in [0, 1) from a murmur3 finaliser over the element's (wrapping uint32) index."""
    h = jnp.full(shape, salt & 0xFFFFFFFF, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        h = h + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= shape[axis]
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = (h ^ (h >> shift)) * jnp.uint32(mult)
    h = h ^ (h >> 16)
    return (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def build_cache(cfg: ModelConfig, mesh: Mesh, *, batch: int, position: int, rows: int, dtype: str,
                seed: int = 1, abstract: bool = False):
    """A replicated cache of capacity ``position + rows`` per sequence, random contents, offset ``position``
    (``abstract``: shapes with shardings only)."""
    capacity = position + rows
    shapes = jax.eval_shape(lambda: init_cache(cfg, batch, capacity, dtype))
    rep = replicated(mesh)
    if abstract:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), shapes)

    def fill():
        leaves, treedef = jax.tree.flatten(shapes)
        out = [(_hash_uniform(x.shape, seed + i) * 2.0 - 1.0).astype(x.dtype)
               if jnp.issubdtype(x.dtype, jnp.floating) else jnp.full(x.shape, position, x.dtype)
               for i, x in enumerate(leaves)]
        return jax.tree.unflatten(treedef, out)

    return jax.jit(fill, out_shardings=jax.tree.map(lambda _: rep, shapes))()


def bytes_per_device(tree) -> int:
    """Bytes one device holds of every array (or sharded ShapeDtypeStruct) in ``tree``; all the rule table's
    shardings are even (padded), so every device holds the same."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total
