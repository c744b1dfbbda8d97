"""Pallas (Triton backend) kernels for the routed experts: PLANNER.md §E steps 3-5.

Two launches over the static tile table of ``grouping.plan_tiles``:

* ``gate_up``: grid (F / BF, T). Program (f, t) gathers its tile's rows of x, runs the gate and up GEMMs
  for one BF-column block of the same expert, applies the clamped SwiGLU and stores bf16(act) in
  expert-sorted pair order: act [P + BM, F]. Given each sorted pair's weight (fp8 GEMM inputs, ``ops``), it
  stores act times the weight (in f32) in the given dtype instead.
* ``down``: grid (D / BN, T). Program (n, t) multiplies the tile's act rows by one BN-row block of w2[e]
  and stores the f32 result in pair order: y [P + BM, D].

The column-block axis is the fast grid axis, so programs of one tile run together and share its
activations in L2 while each weight block streams from HBM once per tile. Tiles with ``count == 0`` (past
the used ones) do nothing.

fp4 weights (MODEL.md §E.1: packed e2m1, low nibble = even column, ue8m0 scale per (row, 32 inputs)) arrive as
16-bit words, four codes each (the op's view of the code bytes, no copy): the Triton lowering addresses an
operand with 64-bit offsets only past 2**32 bytes and counts offsets in elements, so one-byte codes of 2-4 GiB
(a scanned unit's stack of fp4 experts on one rank) would wrap, while 2-byte words never do. They are expanded
to bf16 in registers. Rather than interleave the nibbles, the contraction is split in four planes: word k of a
K chunk holds columns 4k..4k+3, and plane n pairs nibble n of every word with the input columns 4k + n. For
that the GEMM inputs arrive with the columns of every K chunk reordered as [columns ≡ 0, ≡ 1, ≡ 2, ≡ 3 mod 4]:
the caller does it for x, and ``gate_up`` does it for act when w2 is fp4 (per chunk of the down GEMM's K, its
column block then holds w1/w3 rows in that order). Each plane's dot has K = BK/4 (the down chunk / 4 for down):
fp4 K chunks are multiples of 64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes (powers of two) and Triton launch settings of the two kernels.

    block_m: pairs per tile (BM); block_f: act columns per gate/up program (BF); block_k: D chunk of the gate/up
    GEMM (BK); block_n: output columns per down program (BN); down_block_k: F chunk of the down GEMM (0: BF).
    """

    block_m: int = 64
    block_f: int = 64
    block_k: int = 64
    block_n: int = 128
    gate_up_warps: int = 4
    gate_up_stages: int = 4
    down_warps: int = 4
    down_stages: int = 4
    fp4_decode: str = "asm"  # "asm" (inline PTX, GPU only) or "alu" (plain jnp ops; used in interpret mode)
    # fp4: the dequantised weight block is the GEMMs' first operand (outᵀ = W·xᵀ), so Hopper's wgmma may take it
    # from registers rather than through shared memory; the result is transposed once a program
    fp4_weights_first: bool = False
    down_block_k: int = 0

    @property
    def down_chunk(self) -> int:
        """The down GEMM's K chunk (F columns a step); with fp4 experts act is stored in plane order per chunk."""
        return self.down_block_k or self.block_f


_TRANS_B = (((1,), (1,)), ((), ()))  # a [m, k] . b [n, k]^T


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jax.lax.dot_general(a, b, _TRANS_B, preferred_element_type=jnp.float32)


def swiglu(g: jax.Array, u: jax.Array, limit: float) -> jax.Array:
    """Clamped SwiGLU in float32: silu(min(g, lim)) * clip(u, -lim, lim) (gate clipped above only)."""
    g = jnp.minimum(g, limit)
    return g * jax.nn.sigmoid(g) * jnp.clip(u, -limit, limit)


# The e2m1 / ue8m0 decode in registers (the kernel's own form of ``dsv41_jax.formats.decode_fp4``, checked
# bit-exact against it in test_moe.py): a table lookup does not lower to Triton, so the code's bits are placed
# in a float's bits instead.
def _e2m1_to_bf16(nibble: jax.Array, scale: jax.Array) -> jax.Array:
    """nibble: int32 e2m1 codes in [0, 16); scale: f32 2^(s - 127 + 14), same shape. Returns bf16.

    The code's 3 magnitude bits land in an f16's exponent/mantissa (bits 9-11) and its sign in bit 15: that
    f16 is the e2m1 value times 2^-14 (code 1 becomes the f16 subnormal 2^-15, exact); the scale carries
    the 2^14 back.
    """
    bits = ((nibble << 9) & 0x0E00) | ((nibble << 12) & 0x8000)
    value = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)
    return (value * scale).astype(jnp.bfloat16)


def _alu_scale(scale_bits: jax.Array) -> jax.Array:
    """ue8m0 bytes (int32) -> f32 2^(s - 127 + 14), the factor ``_e2m1_to_bf16`` expects."""
    return jax.lax.bitcast_convert_type((scale_bits + 14) << 23, jnp.float32)


# Inline-PTX decode (GPU only): one instance takes two code words (one 32-bit register, $1: bytes 0-1 the first
# word, 2-3 the second) and their two bf16 scales (one bf16x2 register, $2) and writes nibble n of each word as
# bf16 ($0, a bf16x2 register), elementwise per word. ``prmt`` spreads code bytes 0 and 2 (nibbles 0 and 1 of the
# two words) or 1 and 3 (nibbles 2 and 3) to bytes 0 and 2 of a word; shifts and masks put each nibble's 3
# magnitude bits at bf16 bits 6-8 (exponent low bits + first mantissa bit) and its sign at bit 15, which is the
# e2m1 value times 2^-126 (code 1 becomes a bf16 subnormal); one bf16x2 fma by 2^126 makes it exact and a second
# applies the scale. Half-precision fma keeps subnormals (PTX ISA).
PRMT_BYTES_02, PRMT_BYTES_13 = 0x4240, 0x4341
MAG_MASK, SIGN_MASK = 0x01C001C0, 0x80008000
LOW_SHIFTS, HIGH_SHIFTS = (6, 12), (2, 8)  # (magnitude, sign) left shifts for the low / high nibble of a byte
BF16X2_2_POW_126, BF16X2_NEG_ZERO = 0x7E807E80, 0x80008000
# plane n of a word: (byte selector, nibble shifts)
PLANES = ((PRMT_BYTES_02, LOW_SHIFTS), (PRMT_BYTES_02, HIGH_SHIFTS),
          (PRMT_BYTES_13, LOW_SHIFTS), (PRMT_BYTES_13, HIGH_SHIFTS))


def _plane_ptx(selector: int, shifts: tuple[int, int]) -> str:
    mag, sign = shifts
    return " ".join([
        "{ .reg .b32 t, a, b, k, z, zero, sel;",
        f"mov.b32 k, {BF16X2_2_POW_126:#x}; mov.b32 z, {BF16X2_NEG_ZERO:#x}; mov.b32 zero, 0;",
        f"mov.b32 sel, {selector:#x}; prmt.b32 t, $1, zero, sel;",
        f"shl.b32 a, t, {mag}; and.b32 a, a, {MAG_MASK:#x};",
        f"shl.b32 b, t, {sign}; and.b32 b, b, {SIGN_MASK:#x}; or.b32 a, a, b;",
        "fma.rn.bf16x2 a, a, k, z; fma.rn.bf16x2 $0, a, $2, z;",
        "}",
    ])


_PLANE_PTX = tuple(_plane_ptx(selector, shifts) for selector, shifts in PLANES)


def _load_scales(scale_ref, expert, rows, chunk, chunk_len):
    """uint8 [R, chunk_len/32]: the ue8m0 scales of one chunk of an fp4 matrix (scales [E, ., C/32]).

    Too narrow for the asynchronous copies Triton pipelines, so the loops fetch them one step ahead.
    """
    groups = chunk_len // 32
    return scale_ref[expert, rows, pl.ds(chunk * groups, groups)]


def _fp4_planes(words_ref, scale_bits, expert, rows, chunk, chunk_len, use_asm):
    """Dequantise one [R, chunk_len] block of an fp4 matrix held as words [E, ., C/4] (uint16, four codes each)
    given its scales [R, chunk_len/32].

    rows: [R] row indices. Returns 4 planes [R, chunk_len/4] bf16: plane n holds the columns 4k + n.
    """
    quarter, groups = chunk_len // 4, chunk_len // 32
    n_rows = rows.shape[0]
    words = words_ref[expert, rows, pl.ds(chunk * quarter, quarter)]  # uint16 [R, quarter]

    def per_word(small):  # [R, groups] -> [R, quarter]: 8 words (32 codes) share one scale
        wide = jnp.broadcast_to(small[:, :, None], (n_rows, groups, 8))
        return wide.reshape(n_rows, quarter)

    if use_asm:
        scale = per_word(jax.lax.bitcast_convert_type(scale_bits.astype(jnp.uint16) << 7, jnp.bfloat16))
        out = [jax.ShapeDtypeStruct((n_rows, quarter), jnp.bfloat16)]
        return tuple(plt.elementwise_inline_asm(ptx, args=[words, scale], constraints="=r,r,r", pack=2,
                                                result_shape_dtypes=out)[0] for ptx in _PLANE_PTX)
    scale = per_word(_alu_scale(scale_bits.astype(jnp.int32)))
    words = words.astype(jnp.int32)
    return tuple(_e2m1_to_bf16((words >> (4 * n)) & 0xF, scale) for n in range(4))


def _plane_columns(stored: jax.Array, n: int) -> jax.Array:
    """The column each stored position holds when every n-column chunk is in plane order: position p of a chunk
    holds its column 4(p mod n/4) + p div (n/4) (planes of columns ≡ 0, 1, 2, 3 mod 4)."""
    p = stored % n
    return stored - p + 4 * (p % (n // 4)) + p // (n // 4)


def _plane_dots(acc, a_ref, a_rows, start, chunk_len, planes, weights_first: bool) -> jax.Array:
    """acc + Σ_n a[:, plane n of the chunk at ``start``] · planes[n]ᵀ (a's chunk columns in plane order): [A, W];
    with ``weights_first`` its transpose, acc + Σ_n planes[n] · a[:, plane n]ᵀ: [W, A].

    Each plane's product is added to the running accumulator itself, so Triton fuses every add into its dot
    (``dot(p, a, acc)``): four chained MMAs on one accumulator a K step. Summing the planes first and adding the
    sum is slower (measured: see docs/BENCHMARKS.md, section "fp4 experts: one accumulator; the MoE plan as a
    counting sort")."""
    quarter = chunk_len // 4
    for n in range(4):
        a = a_ref[a_rows, pl.ds(start + n * quarter, quarter)]
        acc = acc + (_dot(planes[n], a) if weights_first else _dot(a, planes[n]))
    return acc


def _gate_up_kernel(
    tile_expert_ref, tile_first_ref, tile_count_ref, pair_token_ref, x_ref, *refs,
    fp4: bool, permute_out: bool, cfg: KernelConfig, limit: float, use_asm: bool, weighted: bool,
):
    pair_weight_ref, refs = (refs[0], refs[1:]) if weighted else (None, refs)
    if fp4:
        w1_ref, w1s_ref, w3_ref, w3s_ref, act_ref = refs
    else:
        w1_ref, w3_ref, act_ref = refs
    bm, bf, bk = cfg.block_m, cfg.block_f, cfg.block_k
    f_block, tile = pl.program_id(0), pl.program_id(1)
    count = tile_count_ref[tile]

    @pl.when(count > 0)
    def _():
        expert, first = tile_expert_ref[tile], tile_first_ref[tile]
        row_ok = jax.lax.broadcasted_iota(jnp.int32, (bm,), 0) < count
        tokens = plt.load(pair_token_ref.at[pl.ds(first, bm)], mask=row_ok, other=0)
        stored = f_block * bf + jax.lax.broadcasted_iota(jnp.int32, (bf,), 0)  # this program's act columns
        rows = _plane_columns(stored, cfg.down_chunk) if permute_out else stored  # the w1/w3 rows they hold

        n_steps = x_ref.shape[1] // bk

        def step_bf16(kk, acc):
            g, u = acc
            xk = x_ref[tokens, pl.ds(kk * bk, bk)]
            g = g + _dot(xk, w1_ref[expert, rows, pl.ds(kk * bk, bk)])
            u = u + _dot(xk, w3_ref[expert, rows, pl.ds(kk * bk, bk)])
            return g, u

        def step_fp4(kk, carry):
            g, u, s1, s3 = carry
            ahead = jnp.minimum(kk + 1, n_steps - 1)
            s1_next = _load_scales(w1s_ref, expert, rows, ahead, bk)
            s3_next = _load_scales(w3s_ref, expert, rows, ahead, bk)
            planes1 = _fp4_planes(w1_ref, s1, expert, rows, kk, bk, use_asm)
            planes3 = _fp4_planes(w3_ref, s3, expert, rows, kk, bk, use_asm)
            g = _plane_dots(g, x_ref, tokens, kk * bk, bk, planes1, cfg.fp4_weights_first)
            u = _plane_dots(u, x_ref, tokens, kk * bk, bk, planes3, cfg.fp4_weights_first)
            return g, u, s1_next, s3_next

        zeros = jnp.zeros((bm, bf), jnp.float32)
        if fp4:
            first_scales = (_load_scales(w1s_ref, expert, rows, 0, bk),
                            _load_scales(w3s_ref, expert, rows, 0, bk))
            acc = zeros.T if cfg.fp4_weights_first else zeros
            g, u, _, _ = jax.lax.fori_loop(0, n_steps, step_fp4, (acc, acc, *first_scales))
            if cfg.fp4_weights_first:
                g, u = g.T, u.T
        else:
            g, u = jax.lax.fori_loop(0, n_steps, step_bf16, (zeros, zeros))
        act = swiglu(g, u, limit)
        if weighted:  # each pair's routing weight, in f32, before the store's rounding
            act = act * plt.load(pair_weight_ref.at[pl.ds(first, bm)], mask=row_ok, other=0.0)[:, None]
        act = act.astype(act_ref.dtype)
        mask = jnp.broadcast_to(row_ok[:, None], (bm, bf))
        plt.store(act_ref.at[pl.ds(first, bm), pl.ds(f_block * bf, bf)], act, mask=mask)


def _down_kernel(
    tile_expert_ref, tile_first_ref, tile_count_ref, act_ref, *refs, fp4: bool, cfg: KernelConfig,
    use_asm: bool,
):
    if fp4:
        w2_ref, w2s_ref, y_ref = refs
    else:
        w2_ref, y_ref = refs
    bm, bk, bn = cfg.block_m, cfg.down_chunk, cfg.block_n
    n_block, tile = pl.program_id(0), pl.program_id(1)
    count = tile_count_ref[tile]

    @pl.when(count > 0)
    def _():
        expert, first = tile_expert_ref[tile], tile_first_ref[tile]
        rows = n_block * bn + jax.lax.broadcasted_iota(jnp.int32, (bn,), 0)

        # act rows past `count` belong to other tiles (or are unwritten padding); each only feeds its own
        # output row, which the masked store drops, so they are read unmasked.
        n_steps = act_ref.shape[1] // bk

        def step_bf16(kk, acc):
            a = act_ref[pl.ds(first, bm), pl.ds(kk * bk, bk)]
            return acc + _dot(a, w2_ref[expert, rows, pl.ds(kk * bk, bk)])

        def step_fp4(kk, carry):
            acc, scales = carry
            scales_next = _load_scales(w2s_ref, expert, rows, jnp.minimum(kk + 1, n_steps - 1), bk)
            planes = _fp4_planes(w2_ref, scales, expert, rows, kk, bk, use_asm)
            return _plane_dots(acc, act_ref, pl.ds(first, bm), kk * bk, bk, planes, cfg.fp4_weights_first), scales_next

        zeros = jnp.zeros((bm, bn), jnp.float32)
        if fp4:
            acc = zeros.T if cfg.fp4_weights_first else zeros
            y, _ = jax.lax.fori_loop(0, n_steps, step_fp4, (acc, _load_scales(w2s_ref, expert, rows, 0, bk)))
            if cfg.fp4_weights_first:
                y = y.T
        else:
            y = jax.lax.fori_loop(0, n_steps, step_bf16, zeros)
        row_ok = jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 0) < count
        plt.store(y_ref.at[pl.ds(first, bm), pl.ds(n_block * bn, bn)], y, mask=row_ok)


def _use_asm(cfg: KernelConfig, interpret: bool) -> bool:
    if cfg.fp4_decode not in ("asm", "alu"):
        raise ValueError(f"fp4_decode must be 'asm' or 'alu', got {cfg.fp4_decode!r}")
    return cfg.fp4_decode == "asm" and not interpret


def gate_up(
    plan, x: jax.Array, w1, w3, w1_scale: Optional[jax.Array], w3_scale: Optional[jax.Array], *,
    width: int, permute_out: bool, limit: float, cfg: KernelConfig, interpret: bool,
    pair_weights: Optional[jax.Array] = None, act_dtype=jnp.bfloat16,
) -> jax.Array:
    """act [P + BM, F] in ``act_dtype`` (bf16 by default) for the expert-sorted pairs. x: [N, D] bf16 (each BK
    chunk in plane order when fp4); fp4 w1, w3: uint16 words [E, F, D/4]. ``pair_weights`` f32 [P + BM] (each
    sorted pair's routing weight): act is multiplied by its pair's weight before it is rounded and stored."""
    fp4 = w1_scale is not None
    weighted = pair_weights is not None
    n_tiles = plan.tile_count.shape[0]
    rows_out = plan.pair_token.shape[0]
    weights = (w1, w1_scale, w3, w3_scale) if fp4 else (w1, w3)
    kernel = lambda *refs: _gate_up_kernel(
        *refs, fp4=fp4, permute_out=permute_out, cfg=cfg, limit=limit,
        use_asm=_use_asm(cfg, interpret), weighted=weighted)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows_out, width), act_dtype),
        grid=(width // cfg.block_f, n_tiles),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=cfg.gate_up_warps, num_stages=cfg.gate_up_stages),
        name="moe_gate_up",
    )(plan.tile_expert, plan.tile_first, plan.tile_count, plan.pair_token, x,
      *((pair_weights,) if weighted else ()), *weights)


def down(
    plan, act: jax.Array, w2, w2_scale: Optional[jax.Array], *, dim: int, cfg: KernelConfig,
    interpret: bool,
) -> jax.Array:
    """y [P + BM, D] f32 (unweighted expert outputs, pair order). act: [P + BM, F] bf16."""
    fp4 = w2_scale is not None
    n_tiles = plan.tile_count.shape[0]
    weights = (w2, w2_scale) if fp4 else (w2,)
    kernel = lambda *refs: _down_kernel(*refs, fp4=fp4, cfg=cfg, use_asm=_use_asm(cfg, interpret))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((act.shape[0], dim), jnp.float32),
        grid=(dim // cfg.block_n, n_tiles),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=cfg.down_warps, num_stages=cfg.down_stages),
        name="moe_down",
    )(plan.tile_expert, plan.tile_first, plan.tile_count, act, *weights)
