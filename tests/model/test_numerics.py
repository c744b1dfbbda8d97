"""Building blocks against independent references: the §C.2 rounding points (numpy + ml_dtypes and the
spec's e2m1 table), RoPE, Sinkhorn, the exact f32 product of a bf16 input and an f32 weight, the static cache
layout and the weight loader's refusals."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jaxpr_walk import equations

from dsv41_jax.config import load_named, yarn_inv_freq
from dsv41_jax.loading import load_weights
from dsv41_jax.make_tiny import random_weights
from dsv41_jax.model import ModelOptions, Transformer, WeightsError, init_cache
from dsv41_jax.model.norms import SPLIT_MIN_ROWS, f32_matmul
from dsv41_jax.model.quant import fake_quant_fp4, fake_quant_fp8, round_e2m1
from dsv41_jax.model.rope import DIGITS, apply_rope, inv_frequencies, rope_cos_sin
from pallas_kernels.hc_mix.xla import sinkhorn


def _blocks(x, block):
    return x.reshape(*x.shape[:-1], -1, block)


def test_fp8_window_rounding_matches_numpy_ml_dtypes():
    x = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32) * np.logspace(-6, 3, 128)
    v = _blocks(x, 32)
    amax = np.maximum(np.abs(v).max(-1, keepdims=True), 1e-4)
    scale = 2.0 ** np.ceil(np.log2(amax.astype(np.float64) / 448))
    want = (np.clip(v / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale)
    got = np.asarray(fake_quant_fp8(jnp.asarray(x), 32))
    np.testing.assert_array_equal(got, want.reshape(x.shape).astype(np.float32))


def test_e2m1_rounding_follows_the_spec_table():
    """`MODEL.md` §C.2: |y| ≤ 0.25 → 0, (0.25, 0.75) → 0.5, [0.75, 1.25] → 1, (1.25, 1.75) → 1.5,
    [1.75, 2.5] → 2, (2.5, 3.5) → 3, [3.5, 5] → 4, > 5 → 6, sign kept."""
    table = {0.25: 0, 0.26: 0.5, 0.74: 0.5, 0.75: 1, 1.25: 1, 1.26: 1.5, 1.75: 2, 2.5: 2, 2.51: 3,
             3.49: 3, 3.5: 4, 5.0: 4, 5.01: 6, 6.0: 6}
    y = np.array(list(table), np.float32)
    want = np.array(list(table.values()), np.float32)
    np.testing.assert_array_equal(np.asarray(round_e2m1(jnp.asarray(y))), want)
    np.testing.assert_array_equal(np.asarray(round_e2m1(jnp.asarray(-y))), -want)


@pytest.mark.parametrize("e4m3_scale,block", [(True, 16), (False, 32)])
def test_fp4_rounding_scales(e4m3_scale, block):
    """Compressed KV: scale e4m3(max(amax, 6·2⁻⁹)/6); index keys/queries: 2^⌈log2(max(amax, 6·2⁻¹²⁶)/6)⌉."""
    x = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32) * 3
    v = _blocks(x, block)
    if e4m3_scale:
        amax = np.maximum(np.abs(v).max(-1, keepdims=True), 6 * 2.0**-9)
        scale = (amax / 6).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        amax = np.maximum(np.abs(v).max(-1, keepdims=True), 6 * 2.0**-126)
        scale = (2.0 ** np.ceil(np.log2(amax.astype(np.float64) / 6))).astype(np.float32)
    y = np.clip(v / scale, -6, 6)
    levels = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    # nearest level; ties (exact midpoints) do not occur for these random values
    nearest = levels[np.abs(np.abs(y)[..., None] - levels).argmin(-1)] * np.sign(y)
    got = np.asarray(fake_quant_fp4(jnp.asarray(x), block, e4m3_scale=e4m3_scale))
    np.testing.assert_allclose(got, (nearest * scale).reshape(x.shape), rtol=0, atol=0)


def test_rounding_skipped_when_width_is_not_a_block_multiple():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 40)), jnp.float32)
    assert (fake_quant_fp8(x, 32) == x).all() and (fake_quant_fp4(x, 16, True) == x).all()


def test_rope_rotates_interleaved_pairs_of_the_last_dims_and_inverts():
    cfg = load_named("tiny")
    freqs = inv_frequencies(cfg, 2)
    assert np.allclose(freqs, yarn_inv_freq(cfg, 2), rtol=1e-6)
    x = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)
    pos = np.arange(5) * 7
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), freqs))
    np.testing.assert_array_equal(got[:, :48], x[:, :48])  # the un-rotated 48 dims untouched
    i = 3  # pair 3 = dims 48 + 6, 48 + 7
    phi = pos * np.float32(freqs[i])
    x0, x1 = x[:, 48 + 2 * i], x[:, 49 + 2 * i]
    np.testing.assert_allclose(got[:, 48 + 2 * i], x0 * np.cos(phi) - x1 * np.sin(phi), atol=1e-5)
    np.testing.assert_allclose(got[:, 49 + 2 * i], x1 * np.cos(phi) + x0 * np.sin(phi), atol=1e-5)
    back = apply_rope(jnp.asarray(got), jnp.asarray(pos), freqs, inverse=True)
    np.testing.assert_allclose(np.asarray(back), x, atol=1e-5)


@pytest.mark.parametrize("ratio", [0, 4])
def test_rope_angles_match_float64_at_long_positions(ratio):
    """cos/sin of p·f_i against a float64 numpy angle at 0, 300K and 2^20 − 1 (full model frequencies).
    The f32 digit tables are each rounded once (≤ 6e-8) and combined by two angle additions (a few f32
    ulps each), so ~5e-7 is expected; 1e-5 leaves margin yet is ~1000× below the 1e-2 error of an f32
    angle at 1M that MODEL.md §B.5 warns about."""
    freqs = inv_frequencies(load_named("dsv41_flash"), ratio)
    pos = np.array([0, 300_000, 1_048_575])
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 2 * len(freqs))).astype(np.float32)
    angle = pos[:, None].astype(np.float64) * np.asarray(freqs, np.float64)
    x0, x1 = x[:, 0::2].astype(np.float64), x[:, 1::2].astype(np.float64)
    want = np.stack([x0 * np.cos(angle) - x1 * np.sin(angle), x1 * np.cos(angle) + x0 * np.sin(angle)], -1)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), freqs))
    # |x| ≲ 4 here, so a 1e-5 error in cos/sin is ≤ ~6e-5 in the rotated values
    np.testing.assert_allclose(got, want.reshape(x.shape), rtol=0, atol=6e-5)
    cos, sin = (np.asarray(a) for a in rope_cos_sin(jnp.asarray(pos), freqs))
    np.testing.assert_allclose(cos, np.cos(angle), rtol=0, atol=1e-5)
    np.testing.assert_allclose(sin, np.sin(angle), rtol=0, atol=1e-5)
    neg_cos, neg_sin = (np.asarray(a) for a in rope_cos_sin(jnp.asarray(-pos), freqs))
    np.testing.assert_array_equal(neg_cos, cos)
    np.testing.assert_array_equal(neg_sin, -sin)


def test_rope_tables_are_emitted_once_for_calls_alike():
    """Layers rotate alike: the float64-derived digit tables (DIGITS cos and sin constants a frequency set) enter a
    program once, not once a call — 49 copies were ~90 % of the 40-layer decode step's 21 MB StableHLO."""
    freqs = inv_frequencies(load_named("tiny"), 2)
    x, pos = jnp.ones((4, 64), jnp.float32), jnp.arange(4)

    def three_layers(x):
        for _ in range(3):
            x = apply_rope(x, pos, freqs)
        return x

    text = jax.jit(three_layers).lower(x).as_text()
    tables = [line for line in text.splitlines() if "stablehlo.constant dense<\"0x" in line]
    assert len(tables) == 2 * DIGITS, len(tables)  # per digit: one cos and one sin table


def test_sinkhorn_columns_sum_to_one():
    c = np.random.default_rng(4).random((10, 4, 4)).astype(np.float32) + 1e-6
    out = np.asarray(sinkhorn(jnp.asarray(c), 20, 1e-6))
    np.testing.assert_allclose(out.sum(-2), 1.0, atol=1e-5)
    np.testing.assert_allclose(out.sum(-1), 1.0, atol=1e-3)


@pytest.mark.parametrize("rows", [SPLIT_MIN_ROWS - 1, SPLIT_MIN_ROWS])
def test_f32_matmul_of_bf16_rows_is_the_exact_product_up_to_f32_summation(rows):
    """Both forms (the f32 GEMM below SPLIT_MIN_ROWS rows, the three-piece bf16 GEMM from it) against the float64
    product of the same values. Every product is exact, so the only error is f32 summation over I = 4096 terms,
    ≤ I·2⁻²⁴·Σ|x·w| at worst and near 2⁻²⁴·Σ|x·w| with random signs: measured ≤ 1.31 (f32 GEMM) and ≤ 0.65
    (split) in units of 2⁻²⁴·Σ|x·w| over 5 seeds on CPU; the bound is 2. A split that drops the weight's last
    8 bits (two pieces) measured 3.6 on this data."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((rows, 4096)), jnp.bfloat16)
    w = rng.standard_normal((24, 4096)).astype(np.float32) * np.exp2(rng.integers(-20, 4, (24, 1))).astype(np.float32)
    got = np.asarray(f32_matmul(x, jnp.asarray(w)))
    x64, w64 = np.asarray(x.astype(jnp.float32), np.float64), w.astype(np.float64)
    want, magnitude = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    assert got.dtype == np.float32 and got.shape == (rows, 24)
    assert np.all(np.abs(got - want) <= 2 * 2.0**-24 * magnitude)


def _dot_operand_dtypes(jaxpr, rhs_shape) -> list[tuple]:
    """Operand dtypes of every dot_general in ``jaxpr`` (nested jaxprs included) whose rhs has ``rhs_shape``."""
    return [tuple(str(v.aval.dtype) for v in eqn.invars) for eqn, _ in equations(jaxpr)
            if eqn.primitive.name == "dot_general" and tuple(eqn.invars[1].aval.shape[-2:]) == rhs_shape]


@pytest.mark.parametrize("batch", [1, 8])
def test_hc_products_of_a_batch_run_as_bf16_gemms(batch):
    """A decode step of 8 sequences runs each HC mix's product (streams · fn, fn f32 [24, S·D]) as the split bf16
    GEMM (tensor cores), one sequence as the f32 product. On the H200 the IEEE-f32 GEMM of 8 rows took ~0.45 ms a
    call (cuBLAS, no Triton GEMMs: `compiler.options`): the 40-layer step at batch 8 67 ms, split 28.7 ms
    (docs/BENCHMARKS.md "The HC product at few rows")."""
    cfg = load_named("tiny")
    model = nnx.eval_shape(lambda: Transformer(cfg, ModelOptions(dtype="bfloat16"), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, 32, "bfloat16"))
    ids = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda s, i, c: nnx.merge(graphdef, s)(i, c))(state, ids, cache).jaxpr
    s, d = cfg.hc_mult, cfg.hidden_size
    products = _dot_operand_dtypes(jaxpr, ((2 + s) * s, s * d)) + _dot_operand_dtypes(jaxpr, (3 * (2 + s) * s, s * d))
    assert products, "the step should mix its streams"
    want = ("bfloat16", "bfloat16") if batch >= SPLIT_MIN_ROWS else ("float32", "float32")
    assert set(products) == {want}


def test_cache_shapes_follow_the_roles():
    cfg = load_named("tiny")
    cache = init_cache(cfg, batch=2, max_context=49, dtype="bfloat16")
    for layer, lc in enumerate(cache.layers):
        assert lc.window.shape == (2, cfg.sliding_window, cfg.head_dim)
        full = cfg.role(layer) == "full"
        assert (lc.compressed is not None) == full
        if full:
            assert lc.compressed.shape == (2, math.ceil(49 / cfg.ratio(layer)), cfg.head_dim)
            assert (lc.pending_kv is not None) == (cfg.ratio(layer) == 2)
    assert cache.offset.shape == (2,)


@pytest.fixture(scope="module")
def tiny_model():
    cfg = load_named("tiny")
    return cfg, Transformer(cfg, ModelOptions(dtype="float32"), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("change,message", [
    ("drop", "missing tensor 'layers.3.attn.wq_a.weight'"),
    ("extra", "unexpected tensor 'layers.3.attn.bogus.weight'"),
    ("shape", "tensor 'layers.3.attn.wq_a.weight' has shape (4, 4)"),
])
def test_load_weights_refuses_by_name(tiny_model, change, message):
    cfg, model = tiny_model
    flat = random_weights(cfg, 0)
    if change == "drop":
        del flat["layers.3.attn.wq_a.weight"]
    elif change == "extra":
        flat["layers.3.attn.bogus.weight"] = np.zeros(3, np.float32)
    else:
        flat["layers.3.attn.wq_a.weight"] = np.zeros((4, 4), np.float32)
    with pytest.raises(WeightsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_weights(model, flat)


def test_load_weights_sets_values_in_parameter_dtypes(tiny_model):
    cfg, _ = tiny_model
    model = Transformer(cfg, ModelOptions(dtype="bfloat16"), rngs=nnx.Rngs(0))
    flat = random_weights(cfg, 0)
    load_weights(model, flat)
    w = model.layers[2].attn.compressor.wkv.weight[...]
    assert w.dtype == jnp.float32 and np.array_equal(np.asarray(w), flat["layers.2.attn.compressor.wkv.weight"])
    assert model.embed.weight[...].dtype == jnp.bfloat16
