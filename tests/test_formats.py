"""fp8 / fp4 / ue8m0 codecs against hand-built codes, ml_dtypes casts and the §C.2 rounding table."""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax import formats


def _ref_fp8_scale_byte(block: np.ndarray) -> int:
    """§E.1 written out with Python floats: e = ceil(log2(amax/448)) + 127."""
    amax = float(np.abs(block).max())
    return math.ceil(math.log2(amax / 448.0)) + 127


@pytest.mark.parametrize("shape", [(64, 96), (40, 70), (3, 33, 65)])
def test_fp8_quantize_matches_blockwise_reference(shape):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(shape) * np.exp(rng.uniform(-8, 4, shape))).astype(np.float32)
    codes, scale = formats.fp8_quantize(w)
    assert codes.dtype == ml_dtypes.float8_e4m3fn and codes.shape == w.shape
    assert scale.dtype == ml_dtypes.float8_e8m0fnu
    assert scale.shape == (*shape[:-2], -(-shape[-2] // 32), -(-shape[-1] // 32))
    flat_w, flat_c, flat_s = w.reshape(-1, *shape[-2:]), codes.reshape(-1, *shape[-2:]), scale.reshape(
        -1, *scale.shape[-2:])
    for m in range(flat_w.shape[0]):
        for bi in range(flat_s.shape[1]):
            for bj in range(flat_s.shape[2]):
                sl = (m, slice(32 * bi, 32 * bi + 32), slice(32 * bj, 32 * bj + 32))
                e = _ref_fp8_scale_byte(flat_w[sl])
                assert int(flat_s[m, bi, bj].view(np.uint8)) == e
                # Codes: ml_dtypes' own round-to-nearest-even cast of the scaled block.
                ref = (flat_w[sl].astype(np.float64) / 2.0 ** (e - 127)).astype(np.float32)
                np.testing.assert_array_equal(flat_c[sl].view(np.uint8),
                                              ref.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def test_fp8_round_trip_error_bound_and_block_max():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((96, 128)).astype(np.float32) * 0.02
    codes, scale = formats.fp8_quantize(w)
    back = formats.fp8_dequantize(codes, scale)
    step = np.repeat(np.repeat(formats.scale_values(scale), 32, 0), 32, 1)
    # e4m3 has 3 mantissa bits: rounding error ≤ 2^-4 relative for normals, ≤ half the subnormal step
    # 2^-9 (times the block scale) otherwise.
    bound = np.maximum(np.abs(w) * 2.0 ** -4, step * 2.0 ** -10)
    assert np.all(np.abs(back - w) <= bound)
    # The scale is the smallest power of two that fits: each block's largest code is in (224, 448].
    peak = np.abs(codes.astype(np.float32)).reshape(3, 32, 4, 32).max(axis=(1, 3))
    assert np.all((peak > 224) & (peak <= 448))


def test_fp8_dequantize_hand_built_codes_and_float_scales():
    # e4m3 bytes: 0x38 = 1.0, 0x40 = 2.0, 0xB8 = -1.0, 0x7E = 448, 0x01 = 2^-9 (smallest subnormal).
    raw = np.array([[0x38, 0x40], [0xB8, 0x7E]], dtype=np.uint8)
    codes = np.tile(raw, (20, 20))  # [40, 40]: 2×2 blocks, the edge blocks partial
    codes[0, 0] = 0x01
    scale_bytes = np.array([[127, 130], [120, 127]], dtype=np.uint8)
    out = formats.fp8_dequantize(codes.view(ml_dtypes.float8_e4m3fn), formats.as_ue8m0(scale_bytes))
    values = {0x38: 1.0, 0x40: 2.0, 0xB8: -1.0, 0x7E: 448.0, 0x01: 2.0 ** -9}
    for i, j in [(0, 0), (0, 1), (1, 35), (33, 2), (39, 39), (35, 36)]:
        expect = values[int(codes[i, j])] * 2.0 ** (int(scale_bytes[i // 32, j // 32]) - 127)
        assert out[i, j] == expect
    # A float scale is the multiplier itself; raw uint8 codes are read as e4m3 bytes.
    as_float = formats.fp8_dequantize(codes, np.ldexp(1.0, scale_bytes.astype(int) - 127).astype(np.float32))
    np.testing.assert_array_equal(as_float, out)


# §C.2: |y| ≤ 0.25 → 0, (0.25, 0.75) → 0.5, [0.75, 1.25] → 1, (1.25, 1.75) → 1.5, [1.75, 2.5] → 2,
# (2.5, 3.5) → 3, [3.5, 5] → 4, > 5 → 6, sign kept.
C2_TABLE = [(0.0, 0.0), (0.25, 0.0), (0.2500001, 0.5), (0.7499999, 0.5), (0.75, 1.0), (1.25, 1.0),
            (1.2500001, 1.5), (1.7499999, 1.5), (1.75, 2.0), (2.5, 2.0), (2.5000002, 3.0), (3.4999998, 3.0),
            (3.5, 4.0), (5.0, 4.0), (5.0000005, 6.0), (6.0, 6.0)]


@pytest.mark.parametrize("y,expect", C2_TABLE)
def test_fp4_rounding_table(y, expect):
    for sign in (1.0, -1.0):
        code = formats.fp4_codes(np.array([sign * y], dtype=np.float32))
        assert formats.fp4_values(code)[0] == sign * expect


def test_fp4_rounding_equals_ml_dtypes_cast_on_a_dense_grid():
    y = np.linspace(-6.0, 6.0, 48001, dtype=np.float32)  # step 2.5e-4: hits every tie exactly
    ours = formats.fp4_values(formats.fp4_codes(y))
    ref = y.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(ours, ref)


def test_fp4_pack_layout_low_nibble_is_even_column():
    codes = np.array([[1, 2, 3, 15, 0, 8]], dtype=np.uint8)
    packed = formats.fp4_pack(codes)
    assert packed.dtype == np.int8
    assert packed.view(np.uint8).tolist() == [[0x21, 0xF3, 0x80]]
    np.testing.assert_array_equal(formats.fp4_unpack(packed), codes)


def test_fp4_dequantize_hand_built():
    # Row 0: code 2 (1.0) at even columns and code 13 (-3.0) at odd columns; scale 2^1 then 2^-2.
    packed = np.full((2, 32), 0xD2, dtype=np.uint8).view(np.int8)  # [2, 64/2]
    scale = formats.as_ue8m0(np.array([[128, 125], [127, 127]], dtype=np.uint8))
    out = formats.fp4_dequantize(packed, scale)
    assert out.shape == (2, 64)
    np.testing.assert_array_equal(out[0, :32:2], 2.0)
    np.testing.assert_array_equal(out[0, 1:32:2], -6.0)
    np.testing.assert_array_equal(out[0, 32::2], 0.25)
    np.testing.assert_array_equal(out[0, 33::2], -0.75)
    np.testing.assert_array_equal(out[1, ::2], 1.0)


def test_fp4_quantize_scale_and_round_trip():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 16, 96)).astype(np.float32)
    packed, scale = formats.fp4_quantize(w)
    assert packed.shape == (4, 16, 48) and scale.shape == (4, 16, 3)
    groups = w.reshape(4, 16, 3, 32)
    expect = np.vectorize(lambda a: math.ceil(math.log2(a / 6.0)) + 127)(np.abs(groups).max(-1))
    np.testing.assert_array_equal(scale.view(np.uint8), expect)
    back = formats.fp4_dequantize(packed, scale)
    # Independent rounding: ml_dtypes' e2m1 cast (nearest, ties to even) of w / scale.
    step = np.repeat(formats.scale_values(scale), 32, axis=-1)
    ref = (w / step).astype(np.float32).astype(ml_dtypes.float4_e2m1fn).astype(np.float64) * step
    np.testing.assert_array_equal(back, ref.astype(np.float32))
    # Values dequantise exactly into bfloat16 (§E.1): a bf16 round trip changes nothing.
    np.testing.assert_array_equal(back.astype(ml_dtypes.bfloat16).astype(np.float32), back)


def test_fp4_rejects_bad_width_and_zero_block():
    with pytest.raises(ValueError, match="multiple of 32"):
        formats.fp4_quantize(np.ones((2, 40), np.float32))
    packed, scale = formats.fp4_quantize(np.zeros((1, 32), np.float32))
    np.testing.assert_array_equal(formats.fp4_dequantize(packed, scale), 0.0)


def test_round_trip_kinds():
    w = np.array([[1.0 + 2.0 ** -10] * 32] * 32, dtype=np.float32)
    assert formats.round_trip(w, "f32")[0, 0] == w[0, 0]
    assert formats.round_trip(w, "bf16")[0, 0] == 1.0
    assert formats.round_trip(w, "fp8")[0, 0] == 1.0
    assert formats.round_trip(w, "fp4")[0, 0] == 1.0


# --------------------------------------------------------------------- the JAX forms equal the numpy forms
def test_jax_decode_fp4_equals_the_numpy_dequantiser():
    """``decode_fp4`` (the model's and the ops' fp4 decode) = ``fp4_dequantize`` (the loader's), bit for bit, for
    every code and scale bytes 2..252 (above, 6·2^(e−127) overflows f32; byte 1 makes the code 0.5 an f32
    subnormal, which XLA flushes to zero on CPU; byte 0 decodes to 0: it only meets all-zero groups)."""
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, (251, 16), dtype=np.uint8)  # each row: 32 random codes
    scale = np.arange(2, 253, dtype=np.uint8)[:, None]
    want = formats.fp4_dequantize(packed, scale, dtype=np.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = np.asarray(formats.decode_fp4(jnp.asarray(packed), jnp.asarray(scale), dtype), np.float32)
        np.testing.assert_array_equal(got, want)
    assert (np.asarray(formats.decode_fp4(jnp.asarray(packed[:1]), jnp.zeros((1, 1), jnp.uint8), jnp.float32))
            == 0).all()


def test_jax_decode_fp8_equals_the_numpy_dequantiser():
    """``decode_fp8`` (the fp8 op's decode) = ``fp8_dequantize`` (the loader's), bit for bit, for every finite
    e4m3 code, uneven block edges (70 × 45: partial last blocks) and scale bytes 100..154 (no f32 overflow or
    subnormal products)."""
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 256, (2, 70, 45), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn's NaN bytes
    scale = rng.integers(100, 155, (2, 3, 2), dtype=np.uint8)
    want = formats.fp8_dequantize(codes, scale, dtype=np.float32)
    e4m3 = jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn))
    for dtype in (jnp.float32, jnp.bfloat16):
        got = np.asarray(formats.decode_fp8(e4m3, jnp.asarray(scale), dtype), np.float32)
        np.testing.assert_array_equal(got, want)


def test_jax_ue8m0_forms_equal_the_numpy_forms():
    e = np.arange(0, 255, dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(formats.decode_ue8m0(jnp.asarray(e[1:]))), formats.scale_values(e[1:]))
    floats = np.ldexp(1.0, e.astype(np.int32) - 127).astype(np.float32)[1:]
    np.testing.assert_array_equal(np.asarray(formats.ue8m0_bytes(jnp.asarray(floats))), e[1:])
    np.testing.assert_array_equal(formats.ue8m0_from_scales(floats), e[1:])
    np.testing.assert_array_equal(np.asarray(formats.ue8m0_bytes(jnp.asarray(formats.as_ue8m0(e)))), e)
    with pytest.raises(ValueError, match="powers of two"):
        formats.ue8m0_from_scales(np.array([0.75], np.float32))


def test_jax_e2m1_rounding_equals_the_numpy_codes():
    """``round_e2m1`` (rounding points) = ``fp4_values(fp4_codes(·))`` (the quantiser), ties included."""
    y = np.concatenate([np.linspace(-6, 6, 4801, dtype=np.float32), np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5])])
    np.testing.assert_array_equal(np.asarray(formats.round_e2m1(jnp.asarray(y))),
                                  formats.fp4_values(formats.fp4_codes(y)))
