"""Pallas (Triton backend) kernel of the block-scaled fp8 matmul: y = x · Wᵀ with W [N, K] held as stored (e4m3
codes, one ue8m0 scale per 32×32 block, MODEL.md §E.1), dequantised in registers — no bf16 copy of W in memory.

Grid (N / BN, Mp / BM, S). Program (n, m, s) owns BN weight rows (output columns) and BM activation rows and steps
over its split's K range (K / S columns) in BK-wide chunks. Each step loads the [BN, BK] block of codes and its
[BN, BK/32] scale bytes (a row gather of the scale rows ``row // 32``), decodes them to bf16 (exact: an e4m3 value
times a power of two has 4 significant bits) and adds W_blk · x_blkᵀ [BN, BM] to an f32 accumulator: the weights
are the MMA's first operand, so a decode-sized BM of 16 is the MMA's narrow side (Hopper's wgmma may take the
first operand from registers, where the decode leaves it) and a 1-row step wastes MMA rows, not ALU. The result is
transposed once and stored (x's real rows only); with S > 1 each split stores an f32 partial sum [S, Mp, N] that
the caller adds.

f32 activations are not rounded: each x chunk is split exactly into three bf16 pieces (hi + mid + lo, 8 of f32's
24 significant bits each) and the three products against the same decoded W accumulate in f32, so every product
is exact and only the f32 summation rounds (``model.norms.f32_matmul``'s argument with the roles swapped).

``row``: the weights are a stack [L, N, K] (a scanned unit's layers; one layer is a stack of one) and the kernel
reads layer ``row`` in place (a loop-sliced layer handed to a custom call would be copied every step).

Decode of the codes: "cvt" loads them as float8_e4m3fn and converts (Triton's hardware conversion on sm_89+);
"alu" loads the raw bytes and places the 7 magnitude bits in an f16's exponent and mantissa (the e4m3 value times
2^-8; e4m3 subnormals land on f16 subnormals, exact) and the sign in bit 15, then scales by 2^8 in f32. Both are
the codec's ``fp8_dequantize`` bit for bit on every finite code (tested); the NaN codes 0x7F / 0xFF, which no
checkpoint holds (the writer clips to ±448), give NaN ("cvt") or ±480·2^(e−127) ("alu").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.fp8_matmul.tiling import DECODES, SCALE_BLOCK, KernelConfig  # noqa: F401 - re-exported

_TRANS_B = (((1,), (1,)), ((), ()))  # a [m, k] · b [n, k]ᵀ


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jax.lax.dot_general(a, b, _TRANS_B, preferred_element_type=jnp.float32)


def e4m3_alu(codes: jax.Array) -> jax.Array:
    """Raw e4m3 bytes (uint8, any shape) → bf16 values by integer ops and one f32 product (the "alu" decode)."""
    b = codes.astype(jnp.int32)
    bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)  # f16 with e4m3's exponent/mantissa bits: the value × 2^-8
    half = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)
    return (half.astype(jnp.float32) * 256.0).astype(jnp.bfloat16)


def ue8m0_bf16(scale_bytes: jax.Array) -> jax.Array:
    """ue8m0 bytes → bf16 2^(e−127) from its bits (byte 0 gives 0, as the codec's ``decode_ue8m0``)."""
    return jax.lax.bitcast_convert_type(scale_bytes.astype(jnp.uint16) << 7, jnp.bfloat16)


def decode_block(codes: jax.Array, scale_bytes: jax.Array, decode: str) -> jax.Array:
    """codes [R, C] (float8_e4m3fn for "cvt", uint8 for "alu"), scale bytes [R, C/32] (one per row and 32
    columns) → W [R, C] bf16, exact."""
    rows, cols = codes.shape
    groups = cols // SCALE_BLOCK
    scale = ue8m0_bf16(scale_bytes)
    scale = jnp.broadcast_to(scale[:, :, None], (rows, groups, SCALE_BLOCK)).reshape(rows, cols)
    values = codes.astype(jnp.bfloat16) if decode == "cvt" else e4m3_alu(codes)
    return values * scale


def bf16_pieces(x: jax.Array) -> tuple[jax.Array, ...]:
    """x as bf16 pieces that sum to it exactly: (x,) for bf16; (hi, mid, lo) for f32."""
    if x.dtype == jnp.bfloat16:
        return (x,)
    f32 = jnp.float32
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(f32)  # exact: x minus its rounding
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(f32)).astype(jnp.bfloat16)  # exact: the ≤ 8 bits left
    return hi, mid, lo


def _kernel(row_ref, x_ref, codes_ref, scales_ref, out_ref, *, cfg: KernelConfig, steps: int,
            rows_per_group: int, group_width: int, rows: int):
    bn, bm, bk = cfg.block_n, cfg.block_m, cfg.block_k
    n_block, m_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = row_ref[0]
    n0 = n_block * bn
    div = jax.lax.div  # non-negative indices: C division, not jnp's floor division with its sign fix-ups
    scale_rows = div(n0 + jax.lax.broadcasted_iota(jnp.int32, (bn,), 0), SCALE_BLOCK)
    w_start = split * (steps * bk)
    x_start = div(n0, rows_per_group) * group_width + w_start  # grouped weights read their group's x columns

    # x's rows past ``rows`` (the last block's) are not read on a GPU: x comes unpadded (interpret mode pads it)
    x_rows_ok = m_block * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 0) < rows

    def step(kk, acc):
        k0 = w_start + kk * bk
        codes = codes_ref[layer, pl.ds(n0, bn), pl.ds(k0, bk)]
        scale_bytes = scales_ref[layer, scale_rows, pl.ds(div(k0, SCALE_BLOCK), bk // SCALE_BLOCK)]
        w = decode_block(codes, scale_bytes, cfg.decode)
        xk = plt.load(x_ref.at[pl.ds(m_block * bm, bm), pl.ds(x_start + kk * bk, bk)], mask=x_rows_ok, other=0)
        for piece in bf16_pieces(xk):
            acc = acc + _dot(w, piece)
        return acc

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bn, bm), jnp.float32))
    # only x's real rows are stored (a decode row's block holds 15 rows of padding): the caller reads no others
    row_ok = m_block * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 0) < rows
    plt.store(out_ref.at[split, pl.ds(m_block * bm, bm), pl.ds(n0, bn)], acc.T.astype(out_ref.dtype),
              mask=row_ok)


def fp8_matmul_pallas(x: jax.Array, codes: jax.Array, scales: jax.Array, row: jax.Array, *, rows: int,
                      groups: int, out_dtype, cfg: KernelConfig, interpret: bool) -> jax.Array:
    """x [M, G·K] bf16/f32 (``rows`` = M real rows; in interpret mode padded to a multiple of BM, where every
    access must lie inside the array; on a GPU masked loads and stores skip the rows past M); codes [L, N, K]
    (float8_e4m3fn for "cvt", uint8 for "alu"); scales uint8 [L, ⌈N/32⌉, K/32]; row int32 [1] → [S, Mp, N] (Mp: M
    rounded up to BM; rows past M unwritten): y itself in ``out_dtype`` (S = 1) or S f32 partial sums. The caller
    checks the shapes against ``cfg``."""
    m_pad = -(-rows // cfg.block_m) * cfg.block_m
    _, n, k = codes.shape
    steps = k // (cfg.block_k * cfg.k_splits)
    kernel = lambda *refs: _kernel(*refs, cfg=cfg, steps=steps, rows_per_group=n // groups, group_width=k,
                                   rows=rows)
    dtype = out_dtype if cfg.k_splits == 1 else jnp.float32
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((cfg.k_splits, m_pad, n), dtype),
        grid=(n // cfg.block_n, m_pad // cfg.block_m, cfg.k_splits),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        name="fp8_matmul",
    )(row, x, codes, scales)
