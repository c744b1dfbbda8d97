"""``python -m sharding.selfcheck --world N``: the sharded tiny model against one device, on this machine.

Prints the largest logit difference of a 48-token prefill (f32, rounding points off), whether the argmax rows
agree, the collectives of the compiled program, and the kernel wrappers (Pallas ops under ``shard_map``)
against the unsharded ops. For GPUs (the tests cover simulated CPU devices).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import sharding
from dsv41_jax.config import load_named
from dsv41_jax.loading import load_weights
from dsv41_jax.make_tiny import random_weights
from dsv41_jax.model.cache import init_cache
from dsv41_jax.model.transformer import ModelOptions, Transformer
from pallas_kernels.moe.ops import ExpertWeights
from pallas_kernels.moe.ops import routed_experts as moe_op
from pallas_kernels.sparse_attention.ops import sparse_attention as attention_op
from sharding import kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sharding.selfcheck")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--impl", choices=("xla", "pallas"), default="pallas", help="kernel ops' impl")
    args = parser.parse_args(argv)



    if len(jax.devices()) < args.world:
        print(f"error: world {args.world} needs {args.world} devices, {len(jax.devices())} visible", file=sys.stderr)
        return 2
    print(f"devices: {jax.devices()[:args.world]}")
    cfg, options = load_named("tiny"), ModelOptions(dtype="float32", quant_rounding=False)
    flat = random_weights(cfg, seed=0)
    ids = jnp.asarray(np.random.default_rng(1).integers(3, cfg.vocab_size, (2, 48)), jnp.int32)
    cache = init_cache(cfg, batch=2, max_context=64, dtype="float32")
    reference = Transformer(cfg, options)
    load_weights(reference, flat)
    expected = np.asarray(nnx.jit(lambda m, i, c: m(i, c)[0])(reference, ids, cache))
    model, mesh = sharding.prepare(cfg, flat, args.world, options)
    graphdef, state = nnx.split(model)
    program = jax.jit(lambda s, i, c: nnx.merge(graphdef, s)(i, c)[0]).lower(state, ids, cache).compile()
    got = np.asarray(program(state, ids, jax.device_put(cache, sharding.cache_sharding(mesh, cache))))
    census = Counter(re.findall(r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                                r"(?:-start)?\(", program.as_text()))
    print(f"model world {args.world}: max |Δlogit| {np.abs(got - expected).max():.3g}, argmax rows agree "
          f"{(got.argmax(-1) == expected.argmax(-1)).mean():.3f}, collectives {dict(census)}")
    _check_kernels(mesh, args.impl)
    return 0


def _check_kernels(mesh, impl: str) -> None:

    rng = np.random.default_rng(0)
    n_exp, dim, width, rows = 16, 256, 1024, 64
    weights = ExpertWeights(*(jnp.asarray(rng.standard_normal(s) * 0.05, jnp.bfloat16)
                              for s in ((n_exp, width, dim), (n_exp, width, dim), (n_exp, dim, width))))
    x = jnp.asarray(rng.standard_normal((rows, dim)), jnp.bfloat16)
    ids = jnp.asarray(np.argsort(rng.random((rows, n_exp)), axis=1)[:, :4], jnp.int32)
    w = jnp.asarray(rng.random((rows, 4)), jnp.float32)
    expected = np.asarray(moe_op(x, ids, w, weights, swiglu_limit=10.0, impl=impl))
    for layout in ("tp", "ep"):
        got = np.asarray(kernels.routed_experts(x, ids, w, weights, swiglu_limit=10.0, mesh=mesh, layout=layout,
                                                impl=impl))
        print(f"routed_experts ({impl}, {layout}): max |Δ| {np.abs(got - expected).max():.3g} "
              f"of max |y| {np.abs(expected).max():.3g}")
    b, t, h, dh, n, s, k = 1, 64, 64, 128, 256, 64, 32
    args = (jnp.asarray(rng.standard_normal((b, t, h, dh)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((b, n, dh)), jnp.bfloat16),
            jnp.asarray(rng.integers(-1, n, (b, t, k)), jnp.int32),
            jnp.asarray(rng.standard_normal((b, s, dh)), jnp.bfloat16),
            jnp.asarray([0], jnp.int32), jnp.arange(t, dtype=jnp.int32)[None],
            jnp.asarray(rng.standard_normal(h), jnp.float32))
    kwargs = dict(window_size=32, scale=dh ** -0.5, impl=impl)
    expected = np.asarray(attention_op(*args, **kwargs), np.float32)
    got = np.asarray(kernels.sparse_attention(*args, mesh=mesh, **kwargs), np.float32)
    print(f"sparse_attention ({impl}): max |Δ| {np.abs(got - expected).max():.3g}")


if __name__ == "__main__":
    sys.exit(main())
