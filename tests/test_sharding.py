"""Sharding: the rule table covers every tensor once, splits and padding, weights placed into their shards,
and the shard_map kernel wrappers against the unsharded op (8 simulated CPU devices, tests/conftest)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core.spmd import get_logical_axis_rules
from jax.sharding import PartitionSpec as P

import sharding
import sharding.context as context
from dsv41_jax.config import load_named
from dsv41_jax.loading import build_model
from dsv41_jax.make_tiny import random_weights
from dsv41_jax.model import ModelOptions, WeightsError
from dsv41_jax.param_specs import model_tensors
from pallas_kernels.fp8_matmul.ops import Fp8Weight
from pallas_kernels.fp8_matmul.ops import fp8_matmul as fp8_op
from pallas_kernels.moe.ops import ExpertWeights
from pallas_kernels.moe.ops import routed_experts as moe_op
from pallas_kernels.sparse_attention.ops import sparse_attention as attention_op
from sharding import rules
from sharding.kernels import _expert_spec
from sharding.kernels import fp8_matmul as sharded_fp8_matmul
from sharding.kernels import routed_experts as sharded_routed_experts
from sharding.kernels import sparse_attention as sharded_sparse_attention
from sharding.layout import ShardPlan, Split
from sharding.load import place
from sharding.mesh import ShardingError, make_mesh

# The 128-block splits of PLANNER.md §C, written out from its tables (independent of the planner's code).
F_SPLIT = {1: (2304,), 2: (1152, 1152), 4: (640, 640, 512, 512), 8: (384, 384) + (256,) * 6}
V_SPLIT = {1: (129280,), 2: (64640,) * 2, 4: (32384, 32384, 32256, 32256), 8: (16256,) * 2 + (16128,) * 6}


def full_plan(world: int, layout: str = "tp") -> ShardPlan:
    return ShardPlan(world, layout, Split(V_SPLIT[world]), Split(F_SPLIT[world] if layout == "tp" else (2304,)))


@pytest.mark.parametrize("expert_format,dense_format", [("dequantized", "dequantized"), ("fp4", "fp8")])
@pytest.mark.parametrize("name", ["tiny", "dsv41_flash"])
def test_every_model_tensor_matches_exactly_one_rule(name, expert_format, dense_format):
    cfg = load_named(name)
    for tensor, shape in model_tensors(cfg, expert_format, dspark=True, dense_format=dense_format).items():
        hits = rules.matching_rules(tensor)
        assert len(hits) == 1, (tensor, [h.pattern for h in hits])
        assert hits[0].why
        for layout in rules.LAYOUTS:
            spec = rules.param_spec(tensor, len(shape), layout)
            assert len(spec) == len(shape)
            assert sum(a is not None for a in spec) <= 1  # at most one dim split over the single mesh axis


def test_full_model_rules_follow_model_md_f1():
    """Per-rank shapes at world 4 (MODEL.md §F.1, P = 4 column): 16 heads, 2 groups, 2048 wo_b columns."""
    cfg, plan = load_named("dsv41_flash"), full_plan(4)
    shapes = model_tensors(cfg)

    def per_rank(name):
        padded = list(shapes[name])
        hit = rules.split_axis(name, len(padded), "tp")
        if hit:
            padded[hit[0]] = plan.split(hit[1], padded[hit[0]]).shard
        return tuple(padded)

    assert per_rank("layers.0.attn.wq_b.weight") == (16 * 512, 1280)
    assert per_rank("layers.0.attn.attn_sink") == (16,)
    assert per_rank("layers.0.attn.wo_a.weight") == (2 * 1024, 4096)
    assert per_rank("layers.0.attn.wo_b.weight") == (5120, 2048)
    assert per_rank("layers.3.ffn.experts.w1.weight") == (384, 640, 5120)
    assert per_rank("layers.3.ffn.experts.w2.weight") == (384, 5120, 640)
    assert per_rank("layers.3.ffn.shared_experts.w3.weight") == (640, 5120)
    assert per_rank("embed.weight") == (32384, 5120)
    for replicated in ("layers.2.attn.wkv.weight", "layers.2.attn.indexer.wq_b.weight",
                       "layers.2.attn.compressor.wkv.weight", "layers.5.ffn.gate.weight", "layers.0.hc_attn_fn"):
        assert per_rank(replicated) == shapes[replicated]
    ep = rules.param_spec("layers.3.ffn.experts.w2.weight", 3, "ep")
    assert ep == P("tp", None, None)
    assert rules.param_spec("layers.3.ffn.shared_experts.w2.weight", 2, "ep") == P(None, None)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_split_padding_is_zero_and_invertible(world):
    split = Split(V_SPLIT[world])
    assert split.total == 129280 and split.shard == max(V_SPLIT[world])
    rows = np.arange(split.total, dtype=np.float32)[:, None] + 1.0  # no real row is zero
    padded = split.pad_full(rows, axis=0)
    assert padded.shape == (split.padded_total, 1)
    np.testing.assert_array_equal(padded[split.real_index()], rows)
    assert np.count_nonzero(padded) == split.total  # every other row is padding, and padding is zero
    plan = full_plan(world)
    ids = jnp.asarray([0, 1, 32383, 32384, 64767, 64768, 97151, 129279], jnp.int32)
    np.testing.assert_array_equal(np.asarray(plan.padded_token_ids(ids)), split.real_index()[np.asarray(ids)])
    logits = jnp.asarray(padded[:, 0])
    np.testing.assert_array_equal(np.asarray(plan.real_logits(logits)), rows[:, 0])


@pytest.mark.devices(4)
def test_place_puts_each_rank_s_padded_slice_on_its_device():
    world, plan = 4, full_plan(4)
    mesh = make_mesh(world)
    rng = np.random.default_rng(0)
    host = rng.standard_normal((2, 2304, 8)).astype(np.float32)  # experts.w1 with E = 2, D = 8
    arr = place("layers.0.ffn.experts.w1.weight", host, (2, 2560, 8), np.float32, mesh, plan)
    assert arr.shape == (2, 2560, 8)
    split = plan.expert_width
    for shard in arr.addressable_shards:
        rank = list(mesh.devices.flat).index(shard.device)
        lo = split.start(rank)
        expected = np.zeros((2, 640, 8), np.float32)
        expected[:, : split.sizes[rank]] = host[:, lo: lo + split.sizes[rank]]
        np.testing.assert_array_equal(np.asarray(shard.data), expected)
    with pytest.raises(ValueError, match="expected"):
        place("layers.0.ffn.experts.w1.weight", host[:, :100], (2, 2560, 8), np.float32, mesh, plan)


@pytest.mark.devices(4)
def test_mesh_refuses_unsupported_worlds():
    with pytest.raises(ShardingError, match="world 3"):
        make_mesh(3)
    mesh = make_mesh(4)
    assert mesh.axis_names == ("tp",) and mesh.size == 4
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,)


# ------------------------------------------------------------------------------------ shard_map wrappers
def _moe_reference(x, ids, w, weights, *, swiglu_limit):
    """Dense per-token reference of the routed-experts contract (docs/DESIGN.md), f32 throughout."""
    g = jnp.einsum("nd,efd->nef", x, weights["w1"])
    u = jnp.einsum("nd,efd->nef", x, weights["w3"])
    act = jax.nn.silu(jnp.minimum(g, swiglu_limit)) * jnp.clip(u, -swiglu_limit, swiglu_limit)
    y = jnp.einsum("nef,edf->ned", act, weights["w2"])  # [N, E, D]
    inside = (ids >= 0) & (ids < y.shape[1])  # ids outside [0, E) contribute nothing (the kernel contract)
    picked = jnp.take_along_axis(y, jnp.clip(ids, 0, y.shape[1] - 1)[..., None], axis=1)
    return jnp.sum(jnp.where(inside[..., None], picked * w[..., None], 0.0), axis=1)


@pytest.mark.devices
@pytest.mark.parametrize("world,layout", [(8, "tp"), (8, "ep")])
def test_routed_experts_wrapper_matches_one_device(world, layout):
    rng = np.random.default_rng(1)
    n_exp, dim, width, n_tok, k = 8, 16, 640, 5, 2
    weights = {"w1": rng.standard_normal((n_exp, width, dim)), "w3": rng.standard_normal((n_exp, width, dim)),
               "w2": rng.standard_normal((n_exp, dim, width)) / 8}
    weights = {k_: jnp.asarray(v, jnp.float32) for k_, v in weights.items()}
    x = jnp.asarray(rng.standard_normal((n_tok, dim)) / 4, jnp.float32)
    ids = jnp.asarray(rng.choice(n_exp, (n_tok, k)), jnp.int32)
    w = jnp.asarray(rng.random((n_tok, k)), jnp.float32)
    expected = _moe_reference(x, ids, w, weights, swiglu_limit=1.0)
    if layout == "tp" and world == 8:
        # 640 = 5 blocks of 128 cannot be shared by 8 ranks: use the padded 32-granular split instead.
        split = Split((96,) * 4 + (64,) * 4)
        weights = {"w1": split.pad_full(np.asarray(weights["w1"]), 1),
                   "w3": split.pad_full(np.asarray(weights["w3"]), 1),
                   "w2": split.pad_full(np.asarray(weights["w2"]), 2)}
    got = sharded_routed_experts(x, ids, w, weights, swiglu_limit=1.0, mesh=make_mesh(world), layout=layout,
                                 op=_moe_reference)
    # f32 sums in a different order (per-rank partial sums + psum): a few ulps of values of size ~10.
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.devices(4)
def test_wrappers_run_the_kernel_ops_per_device():
    """The real ops (their xla implementation) under the wrappers at world 4: the ExpertWeights pytree and the
    attention signature go through shard_map; results equal the unsharded op (f32 reassociation only, as above:
    the experts in f32, since the xla implementation rounds each rank's partial w2 product to the operands' dtype)."""
    rng = np.random.default_rng(4)
    mesh = make_mesh(4)
    n_exp, dim, width = 8, 32, 256
    weights = ExpertWeights(*(jnp.asarray(rng.standard_normal(s) * 0.2, jnp.float32)
                              for s in ((n_exp, width, dim), (n_exp, width, dim), (n_exp, dim, width))))
    x = jnp.asarray(rng.standard_normal((6, dim)), jnp.float32)
    ids = jnp.asarray(rng.choice(n_exp, (6, 2)), jnp.int32)
    w = jnp.asarray(rng.random((6, 2)), jnp.float32)
    # Each call jitted, as the model runs them (op by op, the wrappers' shard_map and the op's tile plan dispatch
    # one small program at a time: 7 of this test's 8 s on CPU).
    expected = jax.jit(functools.partial(moe_op, swiglu_limit=1.0, impl="reference"))(x, ids, w, weights)
    for layout in ("tp", "ep"):
        got = jax.jit(functools.partial(sharded_routed_experts, swiglu_limit=1.0, mesh=mesh, layout=layout,
                                        impl="reference"))(x, ids, w, weights)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)

    b, t, h, dh, n, s, k = 1, 2, 8, 32, 4, 4, 2
    args = (jnp.asarray(rng.standard_normal((b, t, h, dh)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((b, n, dh)), jnp.bfloat16),
            jnp.asarray(rng.integers(-1, n, (b, t, k)), jnp.int32),
            jnp.asarray(rng.standard_normal((b, s, dh)), jnp.bfloat16),
            jnp.asarray([0], jnp.int32), jnp.asarray([[2, 3]], jnp.int32),
            jnp.asarray(rng.standard_normal(h), jnp.float32))
    kwargs = dict(window_size=3, scale=dh ** -0.5, impl="reference")
    expected = jax.jit(functools.partial(attention_op, **kwargs))(*args)
    got = jax.jit(functools.partial(sharded_sparse_attention, mesh=mesh, **kwargs))(*args)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))


@pytest.mark.devices(4)
@pytest.mark.parametrize("rule,n,k,groups,stacked", [
    ("layers.0.attn.wq_a", 64, 96, 1, False),            # replicated
    ("layers.0.attn.wq_b", 256, 64, 1, False),           # output rows split: y split like them
    ("layers.0.attn.wo_a", 256, 64, 8, False),           # whole groups a rank: x with its groups' columns
    ("layers.0.attn.wo_b", 64, 256, 1, False),           # input columns split: partial sums, one psum
    ("layers.0.ffn.shared_experts.w2", 64, 256, 1, False),
    ("layers.0.attn.wo_a", 256, 64, 8, True), ("layers.0.attn.wo_b", 64, 256, 1, True)])
def test_fp8_matmul_wrapper_matches_the_op(rule, n, k, groups, stacked):
    """The fp8 dense wrapper at world 4, its specs from the rules of ``rule.weight`` / ``rule.scale`` (with
    ``row``: a scanned unit's stack of 3 layers, read at row 1): the unsharded op's result, up to the order of the
    f32 sums where the input columns are split (f32 x: a few ulps of values of size ~10)."""
    rng = np.random.default_rng(5)
    lead = (3,) if stacked else ()
    codes = rng.choice(np.arange(256, dtype=np.uint8)[np.arange(256) & 0x7F != 0x7F], (*lead, n, k))
    weight = Fp8Weight.from_stored(codes, rng.integers(120, 125, (*lead, n // 32, k // 32), dtype=np.uint8))
    x = jnp.asarray(rng.standard_normal((2, 3, groups * k)), jnp.float32)
    row = {"row": jnp.int32(1)} if stacked else {}
    expected = jax.jit(functools.partial(fp8_op, groups=groups, impl="xla", **row))(x, weight)
    got = jax.jit(functools.partial(sharded_fp8_matmul, rule=rule, groups=groups, mesh=make_mesh(4), layout="tp",
                                    impl="xla", **row))(x, weight)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_every_activation_rule_is_used():
    """Issue #13: the table holds no dead activation rules: each name is pinned somewhere in the package code."""
    root = Path(__file__).resolve().parents[1]
    source = "\n".join(p.read_text() for d in ("dsv41_jax", "sharding") for p in (root / d).rglob("*.py")
                       if p.name != "rules.py")
    unused = [name for name in rules.ACTIVATION_RULES if f'"{name}"' not in source]
    assert not unused, f"activation rules nothing uses: {unused}"


@pytest.mark.devices(2)
@pytest.mark.parametrize("change, message", [
    ("drop", "missing tensor 'layers.3.attn.wq_a.weight' (1 missing in all)"),
    ("extra", "unexpected tensor 'layers.3.attn.bogus.weight' (1 unexpected in all)"),
])
def test_one_and_two_devices_refuse_the_same_weights_by_name(change, message):
    """Issue #13: one loading path (dsv41_jax.loading), so one device and a sharded world refuse alike."""

    cfg, options = load_named("tiny"), ModelOptions(dtype="float32")
    flat = random_weights(cfg, seed=0)
    if change == "drop":
        del flat["layers.3.attn.wq_a.weight"]
    else:
        flat["layers.3.attn.bogus.weight"] = np.zeros((2, 2), np.float32)
    with pytest.raises(WeightsError, match=re.escape(message)):
        build_model(cfg, options, flat)
    with pytest.raises(WeightsError, match=re.escape(message)):
        sharding.prepare(cfg, flat, 2, options)


@pytest.mark.parametrize("layout", rules.LAYOUTS)
@pytest.mark.parametrize("fp4", [False, True])
def test_kernel_expert_specs_are_the_parameter_rules(layout, fp4):
    """Issue #13: each leaf of the MoE kernel's weights takes the rule of the parameter it is a view of (no
    spec written in kernels.py, no substring match on the tree path); an unknown field is refused by name."""
    e, f, d = 4, 64, 32
    if fp4:
        u8 = lambda *s: np.zeros(s, np.uint8)
        weights = ExpertWeights(u8(e, f, d // 2), u8(e, f, d // 2), u8(e, d, f // 2),
                                u8(e, f, d // 32), u8(e, f, d // 32), u8(e, d, f // 32))
        names = {"w1": "w1.codes", "w3": "w3.codes", "w2": "w2.codes", "w1_scale": "w1.scales",
                 "w3_scale": "w3.scales", "w2_scale": "w2.scales"}
    else:
        weights = ExpertWeights(*(np.zeros(s, np.float32) for s in ((e, f, d), (e, f, d), (e, d, f))))
        names = {"w1": "w1.weight", "w3": "w3.weight", "w2": "w2.weight"}
    specs = jax.tree_util.tree_map_with_path(lambda path, a: (path[-1].name, _expert_spec(path, a, layout)),
                                             weights)
    got = dict(jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, tuple)))
    assert got == {field: rules.param_spec(f"layers.7.ffn.experts.{name}", 3, layout)
                   for field, name in names.items()}
    with pytest.raises(KeyError, match="'w4'"):
        jax.tree_util.tree_map_with_path(lambda path, a: _expert_spec(path, a, layout), {"w4": weights.w1})


@pytest.mark.devices(2)
def test_the_mesh_and_layout_travel_in_jax_and_flax_contexts():
    """Issue #13: ``context.activate`` sets JAX's context mesh (readable inside jit: get_abstract_mesh) and Flax's
    logical-axis rules; outside it neither is set and ``constrain`` is the identity."""

    mesh = make_mesh(2)
    seen = {}

    def f(x):
        with context.activate(mesh, "ep"):
            seen["mesh"], seen["layout"] = context.active_mesh(), rules.active_layout()
            seen["rules"] = dict(get_logical_axis_rules())
            return context.constrain(x, "logits_shards")

    jax.jit(f)(jnp.zeros((4, 8)))
    assert seen["mesh"] == mesh.abstract_mesh and seen["layout"] == "ep"
    assert seen["rules"] == rules.LOGICAL_TO_MESH["ep"]
    assert context.active_mesh() is None and rules.active_layout() == "tp"
    assert not hasattr(context, "_ACTIVE")
