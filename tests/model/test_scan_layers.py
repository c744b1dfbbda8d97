"""Scanned layer runs (docs/DESIGN.md "Scanned layers", issue #14).

A run of consecutive reuse layers of one signature is held stacked (``layers.A-B.*`` [n, ...]) and run by one
``lax.scan``; repeats of (a reindex layer, its run) are held as two stacked units (``layers.24_28_32_36.*``,
``layers.25-27_29-31_33-35_37-39.*``) and run by one group scan. Checked here:

* the grouping of the release config (``ModelConfig.layer_steps``);
* the scan computes exactly what the same stacked weights compute unrolled (``scan_layers=False``: n calls of
  one Block) — logits, every cache array and the DSpark taps. Both run the same f32 ops per layer; the only
  freedom XLA has is fusion across the loop boundary, so the bound is 1e-6 (observed: bitwise equal). The
  unrolled path itself is checked against mlx-lm on a config with two runs (``test_parity_mlx.variant_config``);
  the group scan (scanned, the default) against mlx-lm on ``test_parity_mlx.grouped_config``;
* the compiled program does not grow with the number of layers in a run (the point of the scan);
* no loop slices the routed experts: each layer's MoE op reads its unit's whole stack at its row (a loop-sliced
  layer copied all its experts every step); and no loop runs inside another (a group scan's run is unrolled in
  the repeat: a loop there copied the repeat's rows of the run's weights every step);
* the loader maps per-layer tensors onto stacked parameters and names a missing or mis-shaped layer.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxpr_walk import equations, scan_xs

from dsv41_jax.config import load_named
from dsv41_jax.formats import fp8_dequantize
from dsv41_jax.loading import build_model, param_name
from dsv41_jax.model import ModelOptions, Transformer, WeightsError, init_cache
from dsv41_jax.param_specs import is_fp8_dense, layer_names

F32 = ModelOptions(dtype="float32", quant_rounding=True)


def scan_config(run: int = 3):
    """A window layer, a ratio-2 full layer and one stacked run of ``run`` reuse layers (layers 2 .. run + 1),
    whose last three layers are the DSpark taps (so the taps come out of the scan)."""
    n = 2 + run
    return load_named("tiny").replace(
        num_hidden_layers=n, compress_ratios=(0,) + (2,) * (1 + run), kv_source_layer_ids=(1,),
        index_source_layer_ids=(1,), candidate_source_layer_id=-1, num_nextn_predict_layers=0,
        dspark_target_layer_ids=(n - 3, n - 2, n - 1))


def group_config(repeats: int = 3, run: int = 2):
    """A window layer, a ratio-1 full candidate source, then ``repeats`` × (a candidate-masked reindex layer, a
    run of ``run`` reuse layers reading its selections): one group scan; the last three layers are DSpark taps."""
    n = 2 + repeats * (1 + run)
    leads = tuple(2 + r * (1 + run) for r in range(repeats))
    return load_named("tiny").replace(
        num_hidden_layers=n, compress_ratios=(0,) + (1,) * (n - 1), kv_source_layer_ids=(1,),
        index_source_layer_ids=(1, *leads), candidate_source_layer_id=1, candidate_block_size=4,
        candidate_topk_blocks=3, num_nextn_predict_layers=0, dspark_target_layer_ids=(n - 3, n - 2, n - 1))


def test_release_steps():
    """The release: 0-23 as single layers and runs (the full layers 2, 8, 14, 20 own compressed caches, kept per
    layer), then one group scan over the four (reindex, 3 reuse) repeats of 24-39: 12 traced units, not 18."""
    cfg = load_named("dsv41_flash")
    runs = [tuple(range(3, 8)), tuple(range(9, 14)), tuple(range(15, 20)), (21, 22, 23)]
    assert cfg.layer_steps() == (((0,),), ((1,),), ((2,),), (runs[0],), ((8,),), (runs[1],), ((14,),), (runs[2],),
                                 ((20,),), (runs[3],),
                                 ((24, 28, 32, 36), (25, 26, 27, 29, 30, 31, 33, 34, 35, 37, 38, 39)))
    assert sorted(layer for u in cfg.layer_units() for layer in u) == list(range(40))
    assert load_named("tiny").layer_units() == tuple((i,) for i in range(10))  # no two reuse layers adjacent
    # one repeat is no group; nor is a lead whose selections a layer outside its run reads
    assert group_config(repeats=1).layer_steps() == (((0,),), ((1,),), ((2,),), ((3, 4),))
    assert len(group_config(repeats=4, run=1).layer_steps()) == 3


def _run(cfg, options, state):
    """A 12-row prefill of 2 sequences (one padded to 9 rows; the window of 8 wraps), with taps."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, options, rngs=nnx.Rngs(0))))

    @jax.jit
    def call(state, ids, cache, lengths):
        return nnx.merge(graphdef, state).forward(ids, cache, lengths, taps=True)

    ids = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 12)), jnp.int32)
    cache = init_cache(cfg, 2, 32, "float32")
    cache = cache.replace(offset=jnp.array([5, 0], jnp.int32))  # one sequence starts mid-window
    logits, cache, selections, taps = call(state, ids, cache, jnp.array([12, 9], jnp.int32))
    return logits, cache, selections, taps.context


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the 1e-6 bound is the CPU's: on the H200 the same "
                    "test passed once and missed once (GPU reductions need not repeat bit for bit)")
def test_scan_equals_unrolled():
    cfg = scan_config()
    assert cfg.layer_units() == ((0,), (1,), (2, 3, 4))
    state = nnx.state(Transformer(cfg, F32, rngs=nnx.Rngs(1)))
    scanned = _run(cfg, F32, state)
    unrolled = _run(cfg, dataclasses.replace(F32, scan_layers=False), state)
    for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(unrolled), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's bound, as test_scan_equals_unrolled")
def test_group_scan_equals_unrolled_and_the_ungrouped_model(monkeypatch):
    """The group scan (two repeats of a reindex layer and two reuse layers) against (a) the same stacked
    weights run repeat by repeat and layer by layer (``scan_layers=False``) and (b) the same weights run as
    single layers and runs (the path before group scans, itself checked against mlx-lm and by DSpark's tests):
    logits, caches, every selection (the leads' come out of the scan) and the taps."""
    cfg = group_config(repeats=2)
    assert cfg.layer_steps() == (((0,),), ((1,),), ((2, 5), (3, 4, 6, 7)))
    grouped = Transformer(cfg, F32, rngs=nnx.Rngs(1))
    scanned = _run(cfg, F32, nnx.state(grouped))
    unrolled = _run(cfg, dataclasses.replace(F32, scan_layers=False), nnx.state(grouped))
    per_layer = {}
    for path, var in nnx.to_flat_state(nnx.state(grouped, nnx.Param)):
        names = layer_names(param_name(path))
        per_layer.update({n: np.asarray(var[...])[i] for i, n in enumerate(names)} if len(names) > 1
                         else {names[0]: np.asarray(var[...])})
    monkeypatch.setattr(type(cfg), "_group_length", lambda self, units, i: 0)
    assert cfg.layer_units() == ((0,), (1,), (2,), (3, 4), (5,), (6, 7))
    ungrouped = _run(cfg, F32, nnx.state(build_model(cfg, F32, per_layer)))
    assert sorted(scanned[2]) == sorted(ungrouped[2]) == [1, 2, 5]
    for other in (unrolled, ungrouped):
        for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(other), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def _step_hlo(cfg, options) -> str:
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, options, rngs=nnx.Rngs(0))))
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, 32, "float32"))
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.jit(lambda s, i, c: nnx.merge(graphdef, s)(i, c)).lower(state, ids, cache).as_text()


def _ops(hlo: str) -> int:
    return len(re.findall(r"= stablehlo\.\w+", hlo))


def test_program_does_not_grow_with_the_run():
    """A decode step with a run of 2 and of 6 reuse layers lowers to the same ops but for stacking and
    unstacking the 4 extra layers' window rings (3 ops a layer); unrolled, each extra layer adds a whole
    layer's ops (hundreds: the count discriminates)."""
    short, deep = scan_config(2), scan_config(6)
    assert _ops(_step_hlo(deep, F32)) - _ops(_step_hlo(short, F32)) <= 4 * 4
    unrolled = dataclasses.replace(F32, scan_layers=False)
    assert _ops(_step_hlo(deep, unrolled)) - _ops(_step_hlo(short, unrolled)) > 4 * 100


def test_program_does_not_grow_with_the_repeats():
    """A decode step with 2 and with 4 repeats of (reindex, 2 reuse): the 6 extra layers add their rings'
    stacking and splitting (observed 92 ops, ~15 a layer), unrolled each adds a whole layer (observed 6,664)."""
    short, deep = group_config(2), group_config(4)
    assert _ops(_step_hlo(deep, F32)) - _ops(_step_hlo(short, F32)) <= 6 * 20
    unrolled = dataclasses.replace(F32, scan_layers=False)
    assert _ops(_step_hlo(deep, unrolled)) - _ops(_step_hlo(short, unrolled)) > 6 * 100


def test_loader_stacks_a_groups_units():
    """The leads and the runs of a group are stacked units with non-consecutive layers (``layers.2_5_8.*``,
    ``layers.3-4_6-7_9-10.*``): the loader reads them layer by layer and names a missing layer."""
    cfg = group_config()
    model = Transformer(cfg, F32, rngs=nnx.Rngs(3))
    stacked = {param_name(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert {"layers.2_5_8.attn.indexer.wq_b.weight", "layers.3-4_6-7_9-10.attn.wq_a.weight"} <= set(stacked)
    flat = {name: a[i] for stacked_name, a in stacked.items() if len(layer_names(stacked_name)) > 1
            for i, name in enumerate(layer_names(stacked_name))}
    flat.update({k: v for k, v in stacked.items() if len(layer_names(k)) == 1})
    assert "layers.9.ffn.experts.w1.weight" in flat and "layers.8.attn.indexer.wq_b.weight" in flat
    built = build_model(cfg, F32, flat)
    for path, var in nnx.to_flat_state(nnx.state(built, nnx.Param)):
        np.testing.assert_array_equal(np.asarray(var[...]), stacked[param_name(path)])
    with pytest.raises(WeightsError, match=r"layers\.6\.attn\.wkv\.weight"):
        build_model(cfg, F32, {k: v for k, v in flat.items() if k != "layers.6.attn.wkv.weight"})


def test_loader_stacks_per_layer_tensors():
    cfg = scan_config(2)
    model = Transformer(cfg, F32, rngs=nnx.Rngs(3))
    stacked = {param_name(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert "layers.2-3.attn.wq_a.weight" in stacked and "layers.2.attn.wq_a.weight" not in stacked
    flat = {name: a[i] if len(layer_names(stacked_name)) > 1 else a
            for stacked_name, a in stacked.items()
            for i, name in enumerate(layer_names(stacked_name))}
    assert "layers.3.ffn.experts.w1.weight" in flat
    built = build_model(cfg, F32, flat)
    for path, var in nnx.to_flat_state(nnx.state(built, nnx.Param)):
        np.testing.assert_array_equal(np.asarray(var[...]), stacked[param_name(path)])

    missing = {k: v for k, v in flat.items() if k != "layers.3.attn.wkv.weight"}
    with pytest.raises(WeightsError, match=r"layers\.3\.attn\.wkv\.weight"):
        build_model(cfg, F32, missing)
    bad = dict(flat, **{"layers.2.attn.wkv.weight": flat["layers.2.attn.wkv.weight"][:, :-1]})
    with pytest.raises(WeightsError, match=r"layers\.2\.attn\.wkv\.weight"):
        build_model(cfg, F32, bad)


def _scan_inputs(jaxpr) -> list:
    """(loop depth, aval) of every scan's sliced inputs (xs), nested scans included (depth 1 = inside a scan)."""
    return [(depth, aval) for eqn, depth in equations(jaxpr) if eqn.primitive.name == "scan" for aval in scan_xs(eqn)]


@pytest.mark.parametrize("cfg", [scan_config(3), group_config(2)], ids=["run", "group"])
def test_no_loop_slices_the_routed_experts_nor_feeds_a_loop(cfg):
    """The decode step's loops slice every stacked weight but the routed experts: those enter whole and each
    layer's op addresses its row of them (``transformer._split_routed``; the Pallas kernel reads expert e of
    row r at r·E + e). On the H200 a loop-sliced layer copied its E experts every step: 56 ms for a 40-layer
    step whose kernels took 12 ms (docs/BENCHMARKS.md). And no loop runs inside a loop: a group scan's run is
    unrolled in the repeat, since a loop there took the repeat's slice of the run's stacks as its input, a copy
    of n layers' weights every repeat (1.9 ms of a 14.4 ms 40-layer decode step), where the products of an
    unrolled layer read their row of the stacks in place."""
    model = nnx.eval_shape(lambda: Transformer(cfg, F32, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, 32, "float32"))
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda s, i, c: nnx.merge(graphdef, s)(i, c))(state, ids, cache).jaxpr
    found = _scan_inputs(jaxpr)
    sliced = [aval for _, aval in found]
    e, f, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    experts = {(e, f, d), (e, d, f)}
    assert sliced, "the config should have a scanned unit"
    assert any(a.shape[-2:] == (f, d) for a in sliced)            # the shared expert's stack is still sliced
    assert not [a.shape for a in sliced if tuple(a.shape[-3:]) in experts]
    assert {depth for depth, _ in found} == {0}                   # no loop inside a loop


FP8 = dataclasses.replace(F32, dense_format="fp8")


def _per_layer_weights(model, dequantize: bool = True) -> dict:
    """Per-layer model name → array of ``model``'s parameters; with ``dequantize`` every fp8 dense weight held as
    stored (codes + ``.scale`` bytes) dequantised into one weight (MODEL.md §E.1): the same model in the model
    dtype."""
    per_layer = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = layer_names(param_name(path))
        value = np.asarray(var[...])
        per_layer.update({n: value[i] for i, n in enumerate(names)} if len(names) > 1 else {names[0]: value})
    if not dequantize:
        return per_layer
    for scale in [n for n in per_layer if n.endswith(".scale") and is_fp8_dense(n)]:
        weight = scale.removesuffix(".scale") + ".weight"
        per_layer[weight] = fp8_dequantize(per_layer[weight], per_layer.pop(scale))
    return per_layer


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's bound, as test_scan_equals_unrolled")
def test_fp8_dense_weights_in_a_group_scan_equal_the_dequantized_model():
    """fp8 dense weights held as stored (``dense_format="fp8"``) in the leads and runs of a group scan, read at
    each layer's row of their unit's stack: logits, caches, selections and taps as the same weights dequantised
    (bound 1e-6 as above: the op's XLA implementation is the dequantised weight and the same f32 dot)."""
    cfg = group_config(repeats=2)
    fp8 = Transformer(cfg, FP8, rngs=nnx.Rngs(1))
    got = _run(cfg, FP8, nnx.state(fp8))
    want = _run(cfg, F32, nnx.state(build_model(cfg, F32, _per_layer_weights(fp8))))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


@pytest.mark.parametrize("cfg", [scan_config(3), group_config(2)], ids=["run", "group"])
def test_no_loop_slices_the_fp8_dense_weights(cfg):
    """Like the routed experts, fp8 dense weights held as stored enter a loop whole and each layer's op reads its
    row (``dense.Fp8Param``): a loop-sliced layer handed to the Pallas kernel would be a copy of the layer's
    dense weights every step."""
    model = nnx.eval_shape(lambda: Transformer(cfg, FP8, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, 32, "float32"))
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda s, i, c: nnx.merge(graphdef, s)(i, c))(state, ids, cache).jaxpr
    sliced = [aval for _, aval in _scan_inputs(jaxpr)]
    assert sliced, "the config should have a scanned unit"
    assert not [a.shape for a in sliced if a.dtype in (jnp.float8_e4m3fn, jnp.uint8)]


@pytest.mark.devices(4)
def test_fp8_dense_weights_in_a_sharded_group_scan():
    """World 4 (heads, groups and the shared expert's width split; their fp8 stacks read in place at each layer's
    row inside the shard_map wrappers) against the dequantised model on one device, f32 without rounding points:
    only the order of f32 sums differs (the ranks' partial sums all-reduced), so tests/test_sharding_model.py's
    bound 1e-4 (observed 3e-6)."""
    import sharding  # noqa: PLC0415 - the sharded loader; only this test needs it

    cfg = group_config(repeats=2)
    options = dataclasses.replace(FP8, quant_rounding=False)
    fp8 = Transformer(cfg, options, rngs=nnx.Rngs(1))
    stored = _per_layer_weights(fp8, dequantize=False)
    ids = jnp.asarray(np.random.default_rng(1).integers(3, cfg.vocab_size, (2, 24)), jnp.int32)

    def logits(model):
        graphdef, state = nnx.split(model)
        run = jax.jit(lambda state, ids, cache: nnx.merge(graphdef, state)(ids, cache)[0])
        return np.asarray(run(state, ids, init_cache(cfg, 2, 32, "float32")))

    want = logits(build_model(cfg, dataclasses.replace(F32, quant_rounding=False), _per_layer_weights(fp8)))
    model, _ = sharding.prepare(cfg, stored, 4, options)
    np.testing.assert_allclose(logits(model), want, rtol=0, atol=1e-4)
