"""``prepare``: admission, mesh, padded config, sharded weights, and the model wrapper the engine runs.

Engine contract::

    model, mesh = sharding.prepare(cfg, flat, world, options)         # raises PlanRefused if not admitted
    logits, cache = model(ids, cache, lengths)                        # same call as Transformer; logits over
                                                                      # the real vocabulary [B, T, V], replicated
    jit with explicit shardings:  in  = (sharding.state_sharding(model), sharding.cache_sharding(mesh, cache),
                                         sharding.replicated(mesh) for ids / lengths)
                                  out = (sharding.logits_sharding(mesh), sharding.cache_sharding(mesh, cache))

``model.cfg`` is the real config; ``model.run_cfg`` the padded one the inner model was built with;
``model.vocab_size`` the real vocabulary (padded logits never leave the wrapper, so they cannot be sampled).
Caches are replicated (the KV latent is shared by every head, ``MODEL.md`` §F.1): ``init_cache`` with the
real config, then ``jax.device_put(cache, sharding.cache_sharding(mesh, cache))``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from dsv41_jax.planner import admit, kernel_tiles
from sharding import context
from sharding.layout import ShardPlan
from sharding.mesh import make_mesh, replicated


class ShardedTransformer(nnx.Module):
    """A Transformer built with the padded config, its parameters sharded over ``mesh``.

    Call: ``(ids [B, T] int32, cache, lengths [B] | None, engram: EngramInput | None, images: ImageRows | None,
    logit_rows [B] | None) -> (logits [B, T, V] f32 replicated ([B, V] with logit_rows), cache)``.
    ``encode_images(batch)``: the tower and aligner (their weights split by the rule table's vision rules),
    aligner rows [B_img, M, D] replicated. Implements `dsv41_jax.runtime.ModelLike`.
    """

    def __init__(self, inner: nnx.Module, mesh: Mesh, plan: ShardPlan, cfg: Any, run_cfg: Any):
        self.inner = inner
        self.mesh = mesh
        self.plan = plan
        self.cfg = cfg
        self.run_cfg = run_cfg
        self.vocab_size = cfg.vocab_size

    @property
    def engram_layers(self) -> tuple[int, ...]:
        return self.inner.engram_layers

    @property
    def vision(self):
        """The inner model's tower (AttributeError when it was built without the image path)."""
        return self.inner.vision

    @property
    def has_vision(self) -> bool:
        return self.inner.has_vision

    @property
    def has_dspark(self) -> bool:
        return self.inner.has_dspark

    def unwrap(self):
        """(the inner Transformer, its mesh context, (padded ids of real ids, real logits of the inner's)): what a
        program that calls the inner model's parts runs them with (`ModelLike`)."""
        return self.inner, context.activate(self.mesh, self.plan.layout), (self.plan.padded_token_ids,
                                                                            self._real_logits)

    def _real_logits(self, logits):
        """The inner model's logits [..., V_padded] (vocabulary-sharded) as the real ones [..., V], replicated. The
        head's gather (§F.4) moves every rank's padded slice (equal sizes: one all-gather); dropping the padding
        afterwards is local. Dropping it first would make the slices uneven and cost permutes and all-to-alls."""
        logits = context.constrain(logits, "logits_shards")
        return self.plan.real_logits(context.constrain(logits, "logits"))

    def encode_images(self, batch):
        """``vision.batch.ImageBatch`` → aligner rows E [B_img, M, D], replicated (every rank merges them)."""
        with context.activate(self.mesh, self.plan.layout):
            return context.constrain(self.inner.encode_images(batch), "replicated")

    def __call__(self, ids, cache, lengths=None, engram=None, images=None, logit_rows=None):
        with context.activate(self.mesh, self.plan.layout):
            padded_ids = self.plan.padded_token_ids(ids)
            logits, cache = self.inner(padded_ids, cache, lengths=lengths, engram=engram, images=images,
                                       logit_rows=logit_rows)
            logits = self._real_logits(logits)
        return logits, cache


def admission(cfg: Any, world: int):
    """The planner's admission of ``cfg`` at ``world`` (raises ``planner.PlanRefused`` with its message)."""
    return admit(cfg, world)


def prepare(cfg: Any, flat: Any, world: int, options: Any, *, layout: str = "tp",
            devices: list | None = None) -> tuple[ShardedTransformer, Mesh]:
    """The model for ``world`` devices with ``flat``'s weights placed straight into their shards.

    ``flat``: model name → host array (real shapes), or an iterator of such pairs (consumed once).
    ``options``: the model's ``ModelOptions``; without ``tiles``, the planner's for this world
    (``planner.kernel_tiles``). ``layout``: "tp" (experts split on F) or "ep" (whole experts).
    Admission runs first, before any weight is touched; a refused world raises the planner's ``PlanRefused``.
    """
    from dsv41_jax.loading import build_sharded  # noqa: PLC0415 - a cycle: loading imports the model, which imports sharding

    plan = ShardPlan.from_admission(cfg, world, admission(cfg, world), layout)
    if options.tiles is None:
        options = dataclasses.replace(options, tiles=kernel_tiles(cfg, world))
    mesh = make_mesh(world, devices)
    run_cfg = plan.run_config(cfg)
    inner = build_sharded(run_cfg, options, flat, mesh, plan)
    return ShardedTransformer(inner, mesh, plan, cfg, run_cfg), mesh


def state_sharding(model: nnx.Module):
    """The sharding of every array in ``nnx.state(model)`` (a pytree like the state), for jit in_shardings."""
    return jax.tree.map(lambda a: a.sharding, nnx.state(model))


def cache_sharding(mesh: Mesh, cache: Any):
    """Caches are replicated on every rank (`MODEL.md` §F.1): one replicated sharding per cache array."""
    return jax.tree.map(lambda _: replicated(mesh), cache)


def logits_sharding(mesh: Mesh) -> NamedSharding:
    """The wrapper's logits are gathered: replicated."""
    return replicated(mesh)


def param_bytes_per_device(model: nnx.Module) -> dict[int, int]:
    """Bytes of parameter shards held by each device (padding included), keyed by device id."""
    out: dict[int, int] = {}
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        for shard in leaf.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out
