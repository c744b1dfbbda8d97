"""Block-scaled fp8 matmul: every registered implementation (``pallas_kernels.registry``: xla, pallas — interpret
mode on CPU, the compiled kernel on a GPU) through the one op signature against the float64 oracle
``reference.py`` on fresh inputs, at one rank's dense projections of the release (world 1 and world 4); then the
kernel's own parts (the register decode, its configs, its addressing, its lowering for CUDA).

Tolerances: every element within ``reference.error_bound`` (γ_{3K+1} · Σ|x||w| with a truncating f32
accumulator allowed, + 2^-8 of |y| for a bf16 result: the module docstring derives it); f32 results also within
a relative error of ``REL_TOL_F32`` of the whole output — an f32 sum of K ≤ 8,192 products errs by ~√K·u (≤ 1e-5
even with truncation bias), while rounding the activations to bf16 anywhere costs ~2^-9/√3 ≈ 1e-3.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.formats import fp8_dequantize
from pallas_kernels import registry
from pallas_kernels.fp8_matmul import Fp8Weight, fp8_matmul
from pallas_kernels.fp8_matmul import kernel as fp8_kernel
from pallas_kernels.fp8_matmul.ops import DECODE_ROWS, KernelConfig, _check_config, check_offsets, default_config
from pallas_kernels.fp8_matmul.reference import dequantize, error_bound, grouped_matmul
from pallas_kernels.lowering import NoConcreteTarget, cuda_text
from pallas_kernels.registry import IMPLEMENTATIONS

REL_TOL_F32 = 1e-4

# One rank's dense fp8 projections of the release (configs/dsv41_flash.json: D = 5,120, 64 heads of 512,
# q_lora 1,280, o_lora 1,024 in 8 groups, shared expert 2,304, indexer 32 heads of 128; splits of
# sharding/rules.py): (name, N, K, groups, rows M).
REPLICATED = [("wq_a", 1280, 5120, 1, 1), ("wkv", 512, 5120, 1, 3), ("indexer.wq_b", 4096, 1280, 1, 2)]
WORLD_4 = [("wq_b/4", 8192, 1280, 1, 8), ("wo_a/4", 2048, 4096, 2, 1), ("wo_b/4", 5120, 2048, 1, 32),
           ("shared.w13/4", 576, 5120, 1, 5), ("shared.w2/4", 5120, 576, 1, 1)]
WORLD_1 = [("wq_b", 32768, 1280, 1, 1), ("wo_a", 8192, 4096, 8, 2), ("wo_b", 5120, 8192, 1, 1),
           ("shared.w13", 2304, 5120, 1, 8), ("shared.w2", 5120, 2304, 1, 1)]
RELEASE = REPLICATED + WORLD_4 + WORLD_1

FINITE_CODES = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)  # all but the two NaN codes

_seed = iter(range(10_000))


def _rng() -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([52, next(_seed)]))


def _weight(rng, n: int, k: int, lead: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Random finite e4m3 code bytes [*lead, N, K] and ue8m0 scale bytes in a weight-like band (2^-9 .. 2^-3)."""
    codes = rng.choice(FINITE_CODES, size=(*lead, n, k))
    scales = rng.integers(118, 125, size=(*lead, -(-n // 32), -(-k // 32)), dtype=np.uint8)
    return codes, scales


def _x(rng, m: int, width: int, dtype=jnp.bfloat16) -> jax.Array:
    return jnp.asarray(rng.normal(0.0, 1.0, (m, width)), dtype)


@functools.partial(jax.jit, static_argnames=("groups", "out_dtype", "impl", "config"))
def _op(x, weight, *, groups=1, out_dtype=jnp.float32, impl="pallas", config=None):
    return fp8_matmul(x, weight, groups=groups, out_dtype=out_dtype, impl=impl, config=config)


def _assert_within(y, ref: np.ndarray, bound: np.ndarray, *, f32_result: bool) -> None:
    """y within ``bound`` of the oracle's ``ref`` everywhere (and, for f32 results, within REL_TOL_F32
    norm-wise)."""
    y = np.asarray(y, np.float64)
    assert np.all(np.isfinite(y)), "non-finite output"
    excess = np.abs(y - ref) - bound
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess[worst] <= 0, f"element {worst}: {y[worst]} vs {ref[worst]}, past the bound by {excess[worst]}"
    if f32_result:
        rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
        assert rel <= REL_TOL_F32, f"relative error {rel:.2e}"


def _assert_matches(y, x, w64: np.ndarray, *, groups: int = 1, bf16_out: bool = False) -> None:
    """y against the oracle on x and the dequantised W (``_assert_within``)."""
    x = np.asarray(x, np.float64)
    _assert_within(y, grouped_matmul(x, w64, groups), error_bound(x, w64, groups=groups, bf16_out=bf16_out),
                   f32_result=not bf16_out)


@functools.lru_cache(maxsize=1)  # the implementations of one case run one after the other
def _release_case(name: str):
    """A release projection's random weight and x, with the oracle's result and bound (computed once)."""
    _, n, k, groups, m = next(case for case in RELEASE if case[0] == name)
    rng = _rng()
    codes, scales = _weight(rng, n, k)
    x = _x(rng, m, groups * k)
    w64 = dequantize(codes, scales)
    x64 = np.asarray(x, np.float64)
    return Fp8Weight.from_stored(codes, scales), x, grouped_matmul(x64, w64, groups), error_bound(
        x64, w64, groups=groups)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("name,n,k,groups,m", RELEASE, ids=[case[0] for case in RELEASE])
def test_release_projections_match_the_oracle(impl, name, n, k, groups, m):
    """One rank's dense projections at decode sizes (world 1, world 4 and the replicated ones), bf16 x, f32
    result (the accumulation itself)."""
    weight, x, ref, bound = _release_case(name)
    y = _op(x, weight, groups=groups, impl=impl)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    _assert_within(y, ref, bound, f32_result=True)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("n,k,groups,m", [(1280, 5120, 1, 3), (512, 512, 2, 1)])
def test_f32_activations_are_not_rounded(impl, n, k, groups, m):
    """An f32 x is used as is: the result is the f32 accumulation of exact (or once-rounded) products, far
    closer to the oracle than the same op on bf16(x) is (which would pass the bound, not the norm-wise check)."""
    rng = _rng()
    codes, scales = _weight(rng, n, k)
    x = _x(rng, m, groups * k, jnp.float32)
    w64 = dequantize(codes, scales)
    weight = Fp8Weight.from_stored(codes, scales)
    _assert_matches(_op(x, weight, groups=groups, impl=impl), x, w64, groups=groups)
    rounded = np.asarray(_op(x.astype(jnp.bfloat16), weight, groups=groups, impl=impl), np.float64)
    ref = grouped_matmul(np.asarray(x, np.float64), w64, groups)
    assert np.linalg.norm(rounded - ref) / np.linalg.norm(ref) > 10 * REL_TOL_F32  # the check can see rounding


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_the_result_takes_x_s_dtype_by_default(impl, x_dtype):
    """No out_dtype: y in x's dtype, as ``model.norms.linear`` gives for a bf16 weight (one rounding of the f32
    accumulation)."""
    rng = _rng()
    codes, scales = _weight(rng, 1280, 5120)
    x = _x(rng, 2, 5120, x_dtype)
    y = fp8_matmul(x, Fp8Weight.from_stored(codes, scales), impl=impl)
    assert y.dtype == x_dtype
    _assert_matches(y, x, dequantize(codes, scales), bf16_out=x_dtype == jnp.bfloat16)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("m", [DECODE_ROWS + 1, 130])
def test_prefill_sized_rows(impl, m):
    """Past the decode sizes (the 128-row tiles) with a ragged last tile; leading axes [B, T] kept."""
    rng = _rng()
    codes, scales = _weight(rng, 5120, 576)
    x = _x(rng, m, 576)
    y = _op(x.reshape(1, m, 576), Fp8Weight.from_stored(codes, scales), impl=impl)
    assert y.shape == (1, m, 5120)
    _assert_matches(y[0], x, dequantize(codes, scales))


@pytest.mark.parametrize("config", [
    KernelConfig(block_k=64, k_splits=4),                  # partial sums over K
    KernelConfig(decode="alu", k_splits=2),                # integer decode of the codes
    KernelConfig(block_m=32, block_n=16, block_k=32),      # the smallest blocks
    KernelConfig(block_m=16, block_n=128, block_k=128, num_warps=8),
], ids=["splits", "alu", "small", "wide"])
def test_kernel_configs_give_the_same_sums(config):
    rng = _rng()
    codes, scales = _weight(rng, 1024, 1024)
    x = _x(rng, 5, 2048)
    y = _op(x, Fp8Weight.from_stored(codes, scales), groups=2, config=config)
    _assert_matches(y, x, dequantize(codes, scales), groups=2)


@pytest.mark.parametrize("decode", fp8_kernel.DECODES)
def test_register_decode_is_the_codec_for_every_finite_code(decode):
    """The kernel's decode of a [R, 32·G] block (codes × their row's and 32 columns' scale) equals the codec's
    ``fp8_dequantize`` bit for bit, for every finite code and every scale whose products stay normal in bf16
    (bytes 10 .. 246: weights of magnitude 2^-126 .. 2^127)."""
    scale_bytes = np.array([10, 60, 100, 120, 127, 128, 140, 200, 246], np.uint8)
    codes = np.broadcast_to(FINITE_CODES, (len(scale_bytes), len(FINITE_CODES)))  # [9, 254]
    codes = np.pad(codes, ((0, 0), (0, 2)))  # 256 columns: 8 scale groups, each with its row's scale
    scales = np.broadcast_to(scale_bytes[:, None], (len(scale_bytes), 8))
    as_codes = jnp.asarray(codes).view(jnp.float8_e4m3fn) if decode == "cvt" else jnp.asarray(codes)
    got = fp8_kernel.decode_block(as_codes, jnp.asarray(scales), decode)
    assert got.dtype == jnp.bfloat16
    expect = np.concatenate([fp8_dequantize(codes[r:r + 1], scales[r:r + 1], np.float64)
                             for r in range(len(scale_bytes))])
    np.testing.assert_array_equal(np.asarray(got, np.float64), expect)


@pytest.mark.parametrize("n,k", [(64, 96), (40, 72)])
def test_the_oracle_dequantises_as_the_codec(n, k):
    codes, scales = _weight(_rng(), n, k)
    np.testing.assert_array_equal(dequantize(codes, scales), fp8_dequantize(codes, scales, np.float64))


def test_alu_decode_emulated_bits():
    """The "alu" decode's bit placement in numpy: an f16 holding e4m3's exponent and mantissa bits is the e4m3
    value × 2^-8 for every finite code (ml_dtypes), subnormals included."""
    b = FINITE_CODES.astype(np.int32)
    bits = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).astype(np.uint16)
    values = bits.view(np.float16).astype(np.float64) * 256.0
    np.testing.assert_array_equal(values, FINITE_CODES.view(ml_dtypes.float8_e4m3fn).astype(np.float64))


@pytest.mark.parametrize("n,k,groups", [(48, 96, 1), (96, 64, 2)])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_partial_scale_blocks_of_rows(impl, n, k, groups):
    """Rows in whole 16-row blocks but not whole 32-row scale blocks (⌈N/32⌉ scale rows; a group of 48 rows
    shares a scale block with the next): both implementations."""
    rng = _rng()
    codes, scales = _weight(rng, n, k)
    x = _x(rng, 3, groups * k)
    _assert_matches(_op(x, Fp8Weight.from_stored(codes, scales), groups=groups, impl=impl), x,
                    dequantize(codes, scales), groups=groups)


@pytest.mark.parametrize("n,k", [(40, 64), (64, 40), (24, 24)])
def test_ragged_edges_the_kernel_refuses(n, k):
    """Shapes the format admits (partial 32×32 edge blocks) but the kernel does not tile: the XLA path computes
    them; the Pallas path says to use it."""
    rng = _rng()
    codes, scales = _weight(rng, n, k)
    x = _x(rng, 2, k)
    weight = Fp8Weight.from_stored(codes, scales)
    _assert_matches(_op(x, weight, impl="xla"), x, dequantize(codes, scales))
    with pytest.raises(ValueError, match="impl='xla'"):
        fp8_matmul(x, weight, impl="pallas")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_layer_of_a_stack_equals_the_layer_alone(impl):
    """A scanned unit passes its stack [L, N, K] and the layer's row (traced): bitwise the op on that layer."""
    rng = _rng()
    codes, scales = _weight(rng, 256, 512, lead=(3,))
    stack = Fp8Weight.from_stored(codes, scales)
    x = _x(rng, 2, 512)
    run = jax.jit(lambda x, w, row: fp8_matmul(x, w, row=row, impl=impl))
    for row in range(3):
        alone = fp8_matmul(x, Fp8Weight.from_stored(codes[row], scales[row]), impl=impl)
        np.testing.assert_array_equal(np.asarray(run(x, stack, jnp.int32(row))), np.asarray(alone))


def _abstract_weight(n: int, k: int, lead: tuple[int, ...] = ()) -> Fp8Weight:
    return Fp8Weight(jax.ShapeDtypeStruct((*lead, n, k), jnp.float8_e4m3fn),
                     jax.ShapeDtypeStruct((*lead, -(-n // 32), -(-k // 32)), jnp.uint8))


def test_a_stack_is_read_in_place():
    """Lowered for CUDA (no GPU needed): the kernel takes the whole stack of codes; no layer's slice is made."""
    stack = _abstract_weight(512, 1024, lead=(12,))
    x = jax.ShapeDtypeStruct((1, 1024), jnp.bfloat16)
    text = cuda_text(lambda x, w, row: fp8_matmul(x, w, row=row, interpret=False), x, stack,
                             jax.ShapeDtypeStruct((), jnp.int32))
    assert "tensor<12x512x1024xf8E4M3FN>" in text
    assert "dynamic_slice" not in text and "tensor<512x1024xf8E4M3FN>" not in text


def test_calls_alike_lower_the_kernel_once():
    """Two projections of one shape in one program: one jitted kernel function, called twice (the model calls the
    op once a layer; each lowering would build the Triton module again)."""
    w = _abstract_weight(1024, 1024)
    x = jax.ShapeDtypeStruct((1, 1024), jnp.bfloat16)

    def two(x, w):
        return fp8_matmul(fp8_matmul(x, w, interpret=False), w, interpret=False)

    try:
        text = cuda_text(two, x, w, concrete=True)
    except NoConcreteTarget:
        pytest.skip("lowering for CUDA here needs an abstract device, under which each call lowers its own copy")
    assert text.count("stablehlo.custom_call") == 1


def test_a_decode_call_is_one_kernel_on_a_gpu():
    """Lowered for CUDA: a decode row reaches the kernel unpadded (masked loads; no pad fusion before it) and,
    without a K split, nothing runs after it but the slice of its real rows."""
    w = _abstract_weight(8192, 1280)
    x = jax.ShapeDtypeStruct((1, 1280), jnp.bfloat16)
    cfg = KernelConfig(block_k=256, k_splits=1)
    text = cuda_text(lambda x, w: fp8_matmul(x, w, interpret=False, config=cfg), x, w)
    assert text.count("stablehlo.custom_call") == 1 and "stablehlo.pad" not in text
    assert "stablehlo.add" not in text and "stablehlo.reduce" not in text


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m", [1, 32, 2048])
@pytest.mark.parametrize("decode", fp8_kernel.DECODES)
def test_the_triton_lowering_takes_every_path(x_dtype, m, decode):
    """Lowered for CUDA on any machine: decode- and prefill-sized tiles, split and unsplit K, both decodes, bf16
    and f32 activations build a Triton module (what the GPU compiles; a primitive Pallas cannot lower fails
    here)."""
    n, k = 576, 5120
    cfg = dataclasses.replace(default_config(m, n, k), decode=decode)
    x = jax.ShapeDtypeStruct((m, k), x_dtype)
    text = cuda_text(lambda x, w: fp8_matmul(x, w, interpret=False, config=cfg), x,
                             _abstract_weight(n, k))
    assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text


@pytest.mark.parametrize("m", [1, 8, 16, 17, 32, 64, 65, 2048])
def test_default_configs_tile_every_release_projection(m):
    """Pure Python: the default blocks tile every projection at world 1 and 4 (and the tiny model's 16-row
    groups); decode-sized calls get at least one wave of programs where K has the steps for it."""
    for _, n, k, groups, _ in RELEASE + [("tiny.wo_a", 128, 128, 8, 1)]:
        cfg = default_config(m, n, k, groups)
        _check_config(cfg, n, k, groups)
        if m <= DECODE_ROWS:
            programs = (n // cfg.block_n) * cfg.k_splits
            assert programs >= min(132, (n // cfg.block_n) * (k // cfg.block_k)), (n, k, cfg)


def test_bad_inputs_raise():
    rng = _rng()
    codes, scales = _weight(rng, 64, 64)
    weight = Fp8Weight.from_stored(codes, scales)
    x = _x(rng, 2, 64)
    with pytest.raises(ValueError, match="needs 128"):
        fp8_matmul(x, weight, groups=2)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        fp8_matmul(x.astype(jnp.float16), weight)
    with pytest.raises(ValueError, match="do not match"):
        fp8_matmul(x, Fp8Weight.from_stored(codes, scales[:1]))
    with pytest.raises(ValueError, match="needs row"):
        fp8_matmul(x, Fp8Weight.from_stored(codes[None], scales[None]))
    with pytest.raises(ValueError, match="must divide"):
        fp8_matmul(_x(rng, 2, 192), weight, groups=3)
    with pytest.raises(ValueError, match="does not tile"):
        fp8_matmul(x, weight, config=KernelConfig(block_n=128))
    with pytest.raises(ValueError, match="impl must be one of"):
        fp8_matmul(x, weight, impl="cuda")


def test_the_op_is_registered():
    ops = importlib.import_module("pallas_kernels.fp8_matmul.ops")
    assert getattr(ops, registry.OPS["fp8_matmul"]) is fp8_matmul


def test_reference_is_the_deprecated_name_of_xla():
    rng = _rng()
    codes, scales = _weight(rng, 64, 64)
    weight = Fp8Weight.from_stored(codes, scales)
    x = _x(rng, 2, 64)
    np.testing.assert_array_equal(np.asarray(fp8_matmul(x, weight, impl="reference")),
                                  np.asarray(fp8_matmul(x, weight, impl="xla")))


def test_stored_forms_are_accepted():
    """Codes as raw bytes or e4m3, scales as uint8, float8_e8m0fnu or float powers of two: one weight."""
    rng = _rng()
    codes, scales = _weight(rng, 64, 96)
    ref = Fp8Weight.from_stored(codes, scales)
    for c, s in [(codes.view(ml_dtypes.float8_e4m3fn), scales.view(ml_dtypes.float8_e8m0fnu)),
                 (codes.view(np.int8), np.ldexp(1.0, scales.astype(np.int32) - 127).astype(np.float32))]:
        other = Fp8Weight.from_stored(c, s)
        np.testing.assert_array_equal(np.asarray(other.scales), np.asarray(ref.scales))
        np.testing.assert_array_equal(np.asarray(other.dequantized(jnp.float32)),
                                      np.asarray(ref.dequantized(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(ref.dequantized(jnp.float32), np.float64), dequantize(codes, scales))
    with pytest.raises(ValueError, match="float8_e4m3fn or raw bytes"):
        Fp8Weight.from_stored(codes.astype(np.float32), scales)


def test_offset_guard_refuses_only_what_the_kernel_would_wrap():
    check_offsets(jax.ShapeDtypeStruct((12, 32768, 1280), jnp.float8_e4m3fn))   # world 1's wq_b stack: 0.5 GB
    check_offsets(jax.ShapeDtypeStruct((40, 32768, 4096), jnp.float8_e4m3fn))   # past 4 GiB: 64-bit offsets
    with pytest.raises(ValueError, match="2.50 GiB"):
        check_offsets(jax.ShapeDtypeStruct((64, 32768, 1280), jnp.float8_e4m3fn))
