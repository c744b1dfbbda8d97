"""The one codec module for the quantised formats (`MODEL.md` §C.1, §C.2, §E.1): fp8 e4m3, fp4 e2m1, ue8m0.

* fp8 weights: e4m3 codes ``[.., out, in]`` + one ue8m0 scale per 32×32 block ``[.., ⌈out/32⌉, ⌈in/32⌉]``.
* fp4 weights: e2m1 codes packed two a byte ``[.., out, in/2]`` (low nibble = even column) + one ue8m0 scale per
  row and 32 inputs ``[.., out, in/32]``.
* fp8 rows (engram tables, `MODEL.md` §B.12): e4m3 codes ``[.., R, d]`` + one ue8m0 scale per row and 32 dims
  ``[.., R, d/32]``.
* ue8m0: an unsigned byte ``e`` meaning ``2^(e−127)``; stored as ``ml_dtypes.float8_e8m0fnu`` (safetensors
  ``F8_E8M0``) or plain ``uint8``. Dequantisers also accept float scales (the multiplier itself, §G.12).

Numpy forms: quantisers for writing (the tiny generator), dequantisers for loading (the checkpoint reader).
JAX forms (the last section): the decoders the model and the kernel ops run under jit (packed fp4 experts, ue8m0
bytes) and the e4m3 / e2m1 roundings of the §C.2 rounding points (``model/quant.py``). Both forms share the
tables below. Every dequantised value is exact in bfloat16 and float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

FP8_MAX = 448.0
FP4_MAX = 6.0
BLOCK = 32
UE8M0_BIAS = 127
# e2m1 magnitudes of codes 0..7; bit 3 of a code is the sign (§C.1).
FP4_LEVELS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
FP4_VALUES = np.concatenate([FP4_LEVELS, -FP4_LEVELS])  # the values of codes 0..15 (code 8 is −0)
# Rounding to the nearest e2m1 level with ties to the even code (§C.2): the magnitude's level index is the number
# of these thresholds it exceeds (ties go down) plus the number it reaches (ties go up).
FP4_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
FP4_TIES_UP = (0.75, 1.75, 3.5)


# --------------------------------------------------------------------------------------------------- ue8m0
def ceil_log2(x: np.ndarray) -> np.ndarray:
    """Exact ⌈log2 x⌉ for x > 0 (via frexp: x = m·2^k, m ∈ [0.5, 1))."""
    m, k = np.frexp(np.asarray(x, dtype=np.float64))
    return np.where(m == 0.5, k - 1, k).astype(np.int32)


def ue8m0_from_amax(amax: np.ndarray, qmax: float) -> np.ndarray:
    """Block scale byte ``e = ⌈log2(amax/qmax)⌉ + 127`` (§E.1), clamped to 0..254; all-zero blocks get 0."""
    amax = np.asarray(amax, dtype=np.float64)
    safe = np.where(amax > 0, amax / qmax, 2.0 ** -UE8M0_BIAS)
    return np.clip(ceil_log2(safe) + UE8M0_BIAS, 0, 254).astype(np.uint8)


def scale_values(scale: np.ndarray) -> np.ndarray:
    """ue8m0 bytes (``float8_e8m0fnu`` or ``uint8``) or float multipliers → float64 multipliers."""
    scale = np.asarray(scale)
    if scale.dtype == ml_dtypes.float8_e8m0fnu:
        scale = scale.view(np.uint8)
    if scale.dtype == np.uint8:
        return np.ldexp(1.0, scale.astype(np.int32) - UE8M0_BIAS)
    if np.issubdtype(scale.dtype, np.integer):
        raise TypeError(f"scale dtype {scale.dtype} is neither ue8m0 bytes nor a float")
    return scale.astype(np.float64)


def ue8m0_from_scales(scale: np.ndarray) -> np.ndarray:
    """Scales (ue8m0 bytes or float powers of two, §G.12) → ue8m0 bytes uint8; ValueError for a float scale that
    is not a power of two."""
    value = scale_values(scale)
    exponent = np.round(np.log2(np.maximum(value, np.finfo(np.float64).tiny)))
    if not np.array_equal(np.ldexp(1.0, exponent.astype(np.int32)), value):
        raise ValueError("scales must be powers of two to be held as ue8m0 bytes")
    return np.clip(exponent + UE8M0_BIAS, 0, 254).astype(np.uint8)


def as_ue8m0(e: np.ndarray) -> np.ndarray:
    """Scale bytes as ``float8_e8m0fnu`` (what safetensors writes as ``F8_E8M0``)."""
    return np.ascontiguousarray(e, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)


# ----------------------------------------------------------------------------------------------------- fp8
def _block_amax(w: np.ndarray) -> np.ndarray:
    """max|w| over 32×32 blocks of the last two axes (edges padded with zeros): [.., ⌈O/32⌉, ⌈I/32⌉]."""
    *lead, rows, cols = w.shape
    pr, pc = -rows % BLOCK, -cols % BLOCK
    a = np.abs(np.pad(w, [(0, 0)] * len(lead) + [(0, pr), (0, pc)]))
    a = a.reshape(*lead, (rows + pr) // BLOCK, BLOCK, (cols + pc) // BLOCK, BLOCK)
    return a.max(axis=(-3, -1))


def _expand_blocks(s: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """[.., ⌈O/32⌉, ⌈I/32⌉] → [.., O, I] (each block's value repeated)."""
    return np.repeat(np.repeat(s, BLOCK, axis=-2), BLOCK, axis=-1)[..., :rows, :cols]


def fp8_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [.., O, I] float → (codes e4m3 [.., O, I], scale ue8m0 [.., ⌈O/32⌉, ⌈I/32⌉]) per §E.1."""
    w = np.asarray(w, dtype=np.float32)
    e = ue8m0_from_amax(_block_amax(w), FP8_MAX)
    step = _expand_blocks(scale_values(e), *w.shape[-2:])
    y = np.clip(w / step, -FP8_MAX, FP8_MAX)  # clip before the cast: e4m3fn has no inf (§C.1)
    return y.astype(ml_dtypes.float8_e4m3fn), as_ue8m0(e)


def fp8_dequantize(codes: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """codes [.., O, I] (e4m3, or its raw uint8 bytes), scale [.., ⌈O/32⌉, ⌈I/32⌉] → W [.., O, I]."""
    codes = np.asarray(codes)
    if codes.dtype in (np.uint8, np.int8):
        codes = codes.view(ml_dtypes.float8_e4m3fn)
    step = _expand_blocks(scale_values(scale), *codes.shape[-2:])
    return (codes.astype(np.float64) * step).astype(dtype)


# -------------------------------------------------------------- one ue8m0 scale per 32 values of the last axis
def _scaled_per_32(w: np.ndarray, qmax: float, what: str) -> tuple[np.ndarray, np.ndarray]:
    """w [.., n] (n a multiple of 32; else ValueError starting with ``what``) → (w / its group's scale, clipped
    to ±qmax, f32 [.., n]; the ue8m0 exponents [.., n/32]) — the fp4 weights and the fp8 engram rows (§E.1)."""
    w = np.asarray(w, dtype=np.float32)
    if w.shape[-1] % BLOCK:
        raise ValueError(f"{what} to be a multiple of {BLOCK}, got shape {w.shape}")
    groups = w.reshape(*w.shape[:-1], -1, BLOCK)
    e = ue8m0_from_amax(np.abs(groups).max(axis=-1), qmax)
    return np.clip(groups / scale_values(e)[..., None], -qmax, qmax).reshape(w.shape), e


def _steps_per_32(scale: np.ndarray, n: int) -> np.ndarray:
    """ue8m0 scales [.., ⌈n/32⌉] → float64 multipliers [.., n] (each repeated over its 32 values)."""
    return np.repeat(scale_values(scale), BLOCK, axis=-1)[..., :n]


# ------------------------------------------------------------------------------------ fp8 rows (engram tables)
def fp8_rows_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [.., R, d] (d a multiple of 32) → (codes e4m3 [.., R, d], scale ue8m0 [.., R, d/32]): one scale per
    row and 32 dims, ``⌈log2(amax/448)⌉ + 127`` as for the fp8 blocks."""
    y, e = _scaled_per_32(w, FP8_MAX, "fp8 rows need the last dim")
    return y.astype(ml_dtypes.float8_e4m3fn), as_ue8m0(e)


def fp8_rows_dequantize(codes: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """codes [.., R, d] (e4m3 or its raw bytes), scale [.., R, d/32] → [.., R, d]."""
    codes = np.asarray(codes)
    if codes.dtype in (np.uint8, np.int8):
        codes = codes.view(ml_dtypes.float8_e4m3fn)
    step = _steps_per_32(scale, codes.shape[-1])
    return (codes.astype(np.float64) * step).astype(dtype)


# ----------------------------------------------------------------------------------------------------- fp4
def fp4_codes(y: np.ndarray) -> np.ndarray:
    """Round y (already divided by its scale, |y| ≤ 6) to e2m1 codes 0..15 by the §C.2 table (ties to even)."""
    mag = np.abs(np.asarray(y, dtype=np.float32))
    idx = np.zeros(mag.shape, dtype=np.uint8)
    for t in FP4_TIES_DOWN:
        idx += mag > t
    for t in FP4_TIES_UP:
        idx += mag >= t
    return idx | (np.signbit(y).astype(np.uint8) << 3) * (idx > 0)


def fp4_values(codes: np.ndarray) -> np.ndarray:
    """e2m1 codes 0..15 → float32 values."""
    codes = np.asarray(codes, dtype=np.uint8)
    sign = np.where(codes & 8, -1.0, 1.0).astype(np.float32)
    return sign * FP4_LEVELS[codes & 7]


def fp4_pack(codes: np.ndarray) -> np.ndarray:
    """codes [.., I] (0..15) → int8 [.., I/2]: column 2c in the low nibble, 2c+1 in the high nibble."""
    codes = np.asarray(codes, dtype=np.uint8)
    if codes.shape[-1] % 2:
        raise ValueError(f"fp4 packing needs an even last dim, got {codes.shape}")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(np.int8)


def fp4_unpack(packed: np.ndarray) -> np.ndarray:
    """int8/uint8 [.., I/2] → codes uint8 [.., I]."""
    b = np.asarray(packed).view(np.uint8)
    out = np.empty((*b.shape[:-1], 2 * b.shape[-1]), dtype=np.uint8)
    out[..., 0::2] = b & 0xF
    out[..., 1::2] = b >> 4
    return out


def fp4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [.., O, I] (I a multiple of 32) → (packed int8 [.., O, I/2], scale ue8m0 [.., O, I/32]) per §E.1."""
    y, e = _scaled_per_32(w, FP4_MAX, "fp4 needs the input dim")
    return fp4_pack(fp4_codes(y)), as_ue8m0(e)


def fp4_dequantize(packed: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """packed [.., O, I/2], scale [.., O, I/32] → W [.., O, I]."""
    values = fp4_values(fp4_unpack(packed))
    step = _steps_per_32(scale, values.shape[-1])
    return (values.astype(np.float64) * step).astype(dtype)


# ---------------------------------------------------------------------------------------- quantise-dequantise
def round_trip(w: np.ndarray, kind: str) -> np.ndarray:
    """The float32 values a weight has after being stored as ``kind`` ("bf16", "f32", "fp8", "fp4")."""
    w = np.asarray(w, dtype=np.float32)
    if kind == "f32":
        return w.copy()
    if kind == "bf16":
        return w.astype(ml_dtypes.bfloat16).astype(np.float32)
    if kind == "fp8":
        return fp8_dequantize(*fp8_quantize(w))
    if kind == "fp4":
        return fp4_dequantize(*fp4_quantize(w))
    if kind == "fp8r":
        return fp8_rows_dequantize(*fp8_rows_quantize(w))
    raise ValueError(f"unknown storage kind {kind!r}")


# ------------------------------------------------------------------ JAX forms (kernel ops, rounding points)
def decode_ue8m0(scale_bytes: jax.Array) -> jax.Array:
    """ue8m0 bytes (uint8, any shape) → f32 2^(e−127), built from its bits (exact); byte 0 gives 0 (f32 has no
    normal 2^-127), which only meets zero codes (all-zero groups and padding)."""
    return lax.bitcast_convert_type(scale_bytes.astype(jnp.uint32) << 23, jnp.float32)


def ue8m0_bytes(scale) -> jax.Array:
    """Scales as ue8m0 bytes uint8: uint8 as is, ``float8_e8m0fnu`` by its bits, float powers of two (§G.12) by
    their exponent (clamped to 0..254)."""
    scale = jnp.asarray(scale)
    if scale.dtype == jnp.uint8:
        return scale
    if scale.dtype.itemsize == 1:  # float8_e8m0fnu: the byte is the exponent
        return lax.bitcast_convert_type(scale, jnp.uint8)
    exponent = jnp.round(jnp.log2(scale.astype(jnp.float32))) + UE8M0_BIAS
    return jnp.clip(exponent, 0, 254).astype(jnp.uint8)


def decode_fp8(codes: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """e4m3 codes [.., O, I] float8_e4m3fn and ue8m0 scale bytes [.., ⌈O/32⌉, ⌈I/32⌉] (one per 32×32 block) →
    W [.., O, I] in ``dtype``: W[o, i] = e4m3(codes[o, i]) · 2^(scales[o//32, i//32] − 127), exact in bf16 and
    f32 (4 significant bits times a power of two; §E.1). The JAX form of ``fp8_dequantize``."""
    rows, cols = codes.shape[-2:]
    step = decode_ue8m0(scales)
    step = jnp.repeat(jnp.repeat(step, BLOCK, axis=-2), BLOCK, axis=-1)[..., :rows, :cols]
    return (codes.astype(jnp.float32) * step).astype(dtype)


def decode_fp4(codes: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """Packed e2m1 codes [.., O, I/2] uint8 (low nibble = even column) and ue8m0 scale bytes [.., O, I/32] →
    W [.., O, I] in ``dtype`` (exact in bf16 and f32; §E.1)."""
    codes = codes.astype(jnp.uint8)
    nibbles = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
    values = jnp.asarray(FP4_VALUES)[nibbles.astype(jnp.int32)]
    values = values.reshape(*scales.shape, -1) * decode_ue8m0(scales)[..., None]
    return values.reshape(*codes.shape[:-1], -1).astype(dtype)


def pow2_ceil(v: jax.Array) -> jax.Array:
    """2^ceil(log2(v)) for v > 0, exact (frexp instead of a rounded log2; the JAX form of ``ceil_log2``)."""
    mantissa, exponent = jnp.frexp(v)  # v = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    return jnp.ldexp(jnp.ones_like(v), exponent)


def round_to_e4m3(v: jax.Array) -> jax.Array:
    """v f32 (|v| ≤ 448) rounded to the nearest e4m3fn value (ties to even), in f32: what
    ``v.astype(float8_e4m3fn).astype(float32)`` means, written with ``lax.reduce_precision``. XLA's GPU backend may
    drop a narrowing-then-widening convert pair inside a fusion (its excess-precision default), so the rounding
    point would silently vanish (measured: see docs/BENCHMARKS.md, section "Rounding points on the GPU");
    reduce_precision is kept. IEEE-style e4m3 (``reduce_precision(·, 4, 3)``) equals e4m3fn below 2^8 (same bias,
    normals); e4m3fn's extra top binade [256, 448] is the IEEE format one binade down, scaled by 2; below 2^-6
    (where reduce_precision flushes to zero) the subnormals are the multiples of 2^-9, rounded half to even."""
    mag = jnp.abs(v)
    low = lax.reduce_precision(v, exponent_bits=4, mantissa_bits=3)
    high = 2.0 * lax.reduce_precision(0.5 * v, exponent_bits=4, mantissa_bits=3)
    subnormal = jnp.round(v * 512.0) / 512.0
    return jnp.where(mag >= 128.0, high, jnp.where(mag < 2.0**-6, subnormal, low))


GEMM_INPUTS = ("exact", "fp8")  # the activations entering a GEMM: as computed, or through ``fake_quant_fp8`` first


def fake_quant_fp8(x: jax.Array, block: int = BLOCK) -> jax.Array:
    """x [..., n] rounded to e4m3 values with a power-of-two scale ``2^⌈log2(max(amax, 1e-4)/448)⌉`` per block of
    ``block`` along the last axis, and straight back, in x's dtype (`MODEL.md` §C.2 point #1, and the fp8 GEMM
    inputs of ``model/quant.round_gemm_input`` and the MoE op). A last dim that ``block`` does not divide is
    returned unrounded (as mlx-lm does)."""
    if x.shape[-1] % block:
        return x
    v = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = jnp.maximum(jnp.max(jnp.abs(v), axis=-1, keepdims=True), 1e-4)
    scale = pow2_ceil(amax / FP8_MAX)
    y = round_to_e4m3(jnp.clip(v / scale, -FP8_MAX, FP8_MAX))
    return (y * scale).reshape(x.shape).astype(x.dtype)


def round_e2m1(y: jax.Array) -> jax.Array:
    """Nearest e2m1 level, ties to the even code (§C.2; the JAX form of ``fp4_codes`` + ``fp4_values``);
    y already within ±6."""
    mag = jnp.abs(y)
    code = jnp.zeros(mag.shape, jnp.int32)
    for threshold in FP4_TIES_DOWN:
        code = code + (mag > threshold).astype(jnp.int32)
    for threshold in FP4_TIES_UP:
        code = code + (mag >= threshold).astype(jnp.int32)
    return jnp.sign(y) * jnp.asarray(FP4_LEVELS)[code]
