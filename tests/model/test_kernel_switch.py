"""The ``attention_impl`` / ``moe_impl`` switches call the Pallas kernels (interpret mode on CPU) with the
contracts of docs/DESIGN.md and give what the XLA implementations give."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_helpers import Runner, model_state

from dsv41_jax import planner
from dsv41_jax.config import load_named
from dsv41_jax.loading import build_model
from dsv41_jax.make_tiny import random_weights
from dsv41_jax.model import ModelOptions, attention, indexer, init_cache, moe
from dsv41_jax.model.moe import MoE


def test_pallas_attention_matches_the_xla_path():
    """f32, 56 tokens (window eviction, real top-k selection): the kernel and the XLA implementation compute the same
    f32 softmax; only summation order differs (observed ≤ 3e-6 on logits O(4); tolerance 1e-4).

    The kernel asks for HIGHEST precision on its dots, so on a GPU a float32 model's MMAs run in full f32
    (IEEE), not TF32: the same bound holds there.
    """
    cfg = load_named("tiny")
    flat = random_weights(cfg, 0)
    ids = np.random.default_rng(7).integers(3, cfg.vocab_size - 3, 56)
    out = {}
    for impl in ("xla", "pallas"):
        options = ModelOptions(dtype="float32", quant_rounding=False, attention_impl=impl)
        out[impl] = Runner(cfg, options, model_state(cfg, options, flat), rows=56, max_context=64).prefill(ids, [56])
    assert np.abs(out["pallas"] - out["xla"]).max() < 1e-4


def test_pallas_moe_matches_the_xla_path():
    """bf16 MoE block on the same input: the kernel keeps each expert's w2 product in f32 where mlx-lm (and
    the XLA implementation) round it to bf16 before the weighted sum, so they differ by bf16 rounding: tolerance
    2⁻⁶ of the output scale (≈ two bf16 ulps)."""
    cfg = load_named("tiny")
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 20, cfg.hidden_size)), jnp.bfloat16)
    out = {}
    for impl in ("xla", "pallas"):
        moe = MoE(cfg, dtype=jnp.bfloat16, moe_impl=impl, rngs=nnx.Rngs(5))
        out[impl] = np.asarray(jax.jit(lambda m, v: m(v))(moe, x).astype(jnp.float32))
    scale = np.abs(out["xla"]).max()
    assert np.abs(out["pallas"] - out["xla"]).max() <= scale * 2.0**-6


def test_rows_outside_valid_route_to_no_expert():
    """``MoE(valid=...)``: a padding row or an empty slot's row (``Segment.valid`` false) routes to no expert (id
    -1: no work, so no expert reads), in both implementations: the valid rows' outputs are bitwise the unmasked
    call's, and an invalid row's output is the shared expert's alone."""
    cfg = load_named("tiny")
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 12, cfg.hidden_size)), jnp.bfloat16)
    valid = jnp.asarray(np.arange(12)[None, :] < np.array([[12], [5]]))
    for impl in ("xla", "pallas"):
        moe = MoE(cfg, dtype=jnp.bfloat16, moe_impl=impl, rngs=nnx.Rngs(5))
        whole = np.asarray(jax.jit(lambda m, v: m(v))(moe, x).astype(jnp.float32))
        masked = np.asarray(jax.jit(lambda m, v, ok: m(v, valid=ok))(moe, x, valid).astype(jnp.float32))
        shared = np.asarray(jax.jit(lambda m, v: m.shared_experts(v))(moe, x).astype(jnp.float32))
        ok = np.asarray(valid)
        np.testing.assert_array_equal(masked[ok], whole[ok], err_msg=impl)
        np.testing.assert_array_equal(masked[~ok], shared[~ok], err_msg=impl)
        assert np.abs(whole[~ok] - shared[~ok]).max() > 0, impl  # the routed experts did add to those rows


def test_model_options_take_the_registry_names():
    """``*_impl`` is one of ``pallas_kernels.registry.IMPLEMENTATIONS``; "reference" (the old name of the XLA path)
    is stored as "xla"; anything else is a ValueError naming the field and the choices."""
    options = ModelOptions(attention_impl="reference", moe_impl="pallas")
    assert (options.attention_impl, options.moe_impl, options.indexer_impl, options.hc_impl) == (
        "xla", "pallas", "xla", "xla")
    assert options == ModelOptions(moe_impl="pallas")
    with pytest.raises(ValueError, match=r"ModelOptions.moe_impl must be one of xla \| pallas, got 'cuda'"):
        ModelOptions(moe_impl="cuda")


def test_the_ops_take_the_plans_tiles(monkeypatch):
    """Issue #13 ("the engine obeys the plan"): a model built by `loading.build_model` carries the planner's
    kernel tiles for one device, and its Pallas calls pass them on: the segment's head tile (R4) to a prefill's
    attention, the decode tile (§B.3a) to a one-row step's, BM (§E) to the MoE op, B_idx to the indexer's launches."""
    cfg = load_named("tiny")
    seen = {"head_tile": [], "block_m": [], "budget": []}
    real_attention, real_experts, real_rows = attention.sharded_attention, moe.sharded_experts, indexer.launch_rows

    def attend(*args, head_tile=None, **kwargs):
        seen["head_tile"].append((args[0].shape[1], head_tile))
        return real_attention(*args, head_tile=head_tile, **kwargs)

    def experts(*args, block_m=None, **kwargs):
        seen["block_m"].append(block_m)
        return real_experts(*args, block_m=block_m, **kwargs)

    def rows(*args, budget, **kwargs):
        seen["budget"].append(budget)
        return real_rows(*args, budget=budget, **kwargs)

    monkeypatch.setattr(attention, "sharded_attention", attend)
    monkeypatch.setattr(moe, "sharded_experts", experts)
    monkeypatch.setattr(indexer, "launch_rows", rows)
    options = ModelOptions(dtype="float32", quant_rounding=False, attention_impl="pallas", moe_impl="pallas",
                           indexer_impl="pallas")
    model = build_model(cfg, options, random_weights(cfg, 0))
    tiles = planner.kernel_tiles(cfg, 1)
    assert model.options.tiles == tiles
    graphdef, state = nnx.split(model)
    forward = lambda state, ids, cache: nnx.merge(graphdef, state)(ids, cache)
    cache = init_cache(cfg, batch=1, max_context=32, dtype="float32")
    # traced only (eval_shape): what the model passes the ops, without running the interpreted kernels
    jax.eval_shape(forward, state, jnp.arange(3, 11)[None], cache)   # a prefill segment of 8 rows
    jax.eval_shape(forward, state, jnp.asarray([[5]]), cache)         # a decode step
    assert set(seen["head_tile"]) == {(8, tiles.attention_head_tile), (1, tiles.decode_head_tile)}
    assert set(seen["block_m"]) == {tiles.moe_block_m} and set(seen["budget"]) == {tiles.index_budget}
