"""Pallas (Triton backend) kernels for the routed experts: PLANNER.md §E steps 3-5.

Two launches over the static tile table of ``grouping.plan_tiles``:

* ``gate_up``: grid (F / BF, T). Program (f, t) gathers its tile's rows of x, runs the gate and up GEMMs
  for one BF-column block of the same expert, applies the clamped SwiGLU and stores bf16(act) in
  expert-sorted pair order: act [P + BM, F].
* ``down``: grid (D / BN, T). Program (n, t) multiplies the tile's act rows by one BN-row block of w2[e]
  and stores the f32 result in pair order: y [P + BM, D].

The column-block axis is the fast grid axis, so programs of one tile run together and share its
activations in L2 while each weight block streams from HBM once per tile. Tiles with ``count == 0`` (past
the used ones) do nothing.

fp4 weights (MODEL.md §E.1: packed e2m1, low nibble = even column, ue8m0 scale per (row, 32 inputs)) are
expanded to bf16 in registers. Rather than interleave the two nibbles, the contraction is split in two: the
low nibbles pair with the even input columns and the high nibbles with the odd ones. For that the GEMM
inputs arrive with the columns of every BK chunk reordered as [even columns, odd columns]: the caller
does it for x, and ``gate_up`` does it for act when w2 is fp4 (its column block then holds w1/w3 rows in
that order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.moe.reference import swiglu


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes (powers of two) and Triton launch settings of the two kernels.

    block_m: pairs per tile (BM); block_f: act columns per gate/up program (BF), also the K chunk of the
    down GEMM; block_k: D chunk of the gate/up GEMM (BK); block_n: output columns per down program (BN).
    """

    block_m: int = 64
    block_f: int = 64
    block_k: int = 64
    block_n: int = 128
    gate_up_warps: int = 4
    gate_up_stages: int = 4
    down_warps: int = 4
    down_stages: int = 4


_TRANS_B = (((1,), (1,)), ((), ()))  # a [m, k] . b [n, k]^T


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jax.lax.dot_general(a, b, _TRANS_B, preferred_element_type=jnp.float32)


def _e2m1_to_bf16(nibble: jax.Array, scale_bits: jax.Array) -> jax.Array:
    """nibble: int32 e2m1 codes in [0, 16); scale_bits: int32 ue8m0 bytes, same shape. Returns bf16.

    The code's 3 magnitude bits land in an f16's exponent/mantissa (bits 9-11) and its sign in bit 15: that
    f16 is the e2m1 value times 2^-14 (code 1 becomes the f16 subnormal 2^-15, exact). The f32 scale
    2^(s - 127 + 14) undoes the 2^-14.
    """
    bits = ((nibble << 9) & 0x0E00) | ((nibble << 12) & 0x8000)
    value = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)
    scale = jax.lax.bitcast_convert_type((scale_bits + 14) << 23, jnp.float32)
    return (value * scale).astype(jnp.bfloat16)


def _fp4_halves(codes_ref, scale_ref, expert, rows, chunk, chunk_len):
    """Dequantise one [len(rows), chunk_len] block of an fp4 matrix [E, R, C/2] (+ scales [E, R, C/32]).

    Returns (low, high): [len(rows), chunk_len/2] bf16, the even and the odd columns of the chunk.
    """
    half = chunk_len // 2
    codes = codes_ref[expert, rows, pl.ds(chunk * half, half)].astype(jnp.int32)
    group = chunk * (chunk_len // 32) + jax.lax.broadcasted_iota(jnp.int32, (1, half), 1) // 16
    scale_bits = scale_ref[expert, rows[:, None], group].astype(jnp.int32)
    return _e2m1_to_bf16(codes & 0xF, scale_bits), _e2m1_to_bf16(codes >> 4, scale_bits)


def _even_odd_order(n: int) -> jax.Array:
    """[n] int32: position p holds column 2p (p < n/2) or 2(p - n/2) + 1 of an n-column chunk."""
    p = jax.lax.broadcasted_iota(jnp.int32, (n,), 0)
    return jnp.where(p < n // 2, 2 * p, 2 * (p - n // 2) + 1)


def _gate_up_kernel(
    tile_expert_ref, tile_first_ref, tile_count_ref, pair_token_ref, x_ref, *refs,
    fp4: bool, permute_out: bool, cfg: KernelConfig, limit: float,
):
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
        local = _even_odd_order(bf) if permute_out else jax.lax.broadcasted_iota(jnp.int32, (bf,), 0)
        rows = f_block * bf + local  # which rows of w1/w3 this program's act columns come from

        def step(kk, acc):
            g, u = acc
            if fp4:
                x_even = x_ref[tokens, pl.ds(kk * bk, bk // 2)]
                x_odd = x_ref[tokens, pl.ds(kk * bk + bk // 2, bk // 2)]
                w1_even, w1_odd = _fp4_halves(w1_ref, w1s_ref, expert, rows, kk, bk)
                w3_even, w3_odd = _fp4_halves(w3_ref, w3s_ref, expert, rows, kk, bk)
                g = g + _dot(x_even, w1_even) + _dot(x_odd, w1_odd)
                u = u + _dot(x_even, w3_even) + _dot(x_odd, w3_odd)
            else:
                xk = x_ref[tokens, pl.ds(kk * bk, bk)]
                g = g + _dot(xk, w1_ref[expert, rows, pl.ds(kk * bk, bk)])
                u = u + _dot(xk, w3_ref[expert, rows, pl.ds(kk * bk, bk)])
            return g, u

        zeros = jnp.zeros((bm, bf), jnp.float32)
        n_steps = x_ref.shape[1] // bk
        g, u = jax.lax.fori_loop(0, n_steps, step, (zeros, zeros))
        act = swiglu(g, u, limit).astype(act_ref.dtype)
        mask = jnp.broadcast_to(row_ok[:, None], (bm, bf))
        plt.store(act_ref.at[pl.ds(first, bm), pl.ds(f_block * bf, bf)], act, mask=mask)


def _down_kernel(
    tile_expert_ref, tile_first_ref, tile_count_ref, act_ref, *refs, fp4: bool, cfg: KernelConfig,
):
    if fp4:
        w2_ref, w2s_ref, y_ref = refs
    else:
        w2_ref, y_ref = refs
    bm, bk, bn = cfg.block_m, cfg.block_f, cfg.block_n
    n_block, tile = pl.program_id(0), pl.program_id(1)
    count = tile_count_ref[tile]

    @pl.when(count > 0)
    def _():
        expert, first = tile_expert_ref[tile], tile_first_ref[tile]
        rows = n_block * bn + jax.lax.broadcasted_iota(jnp.int32, (bn,), 0)

        # act rows past `count` belong to other tiles (or are unwritten padding); each only feeds its own
        # output row, which the masked store drops, so they are read unmasked.
        def step(kk, acc):
            if fp4:
                a_even = act_ref[pl.ds(first, bm), pl.ds(kk * bk, bk // 2)]
                a_odd = act_ref[pl.ds(first, bm), pl.ds(kk * bk + bk // 2, bk // 2)]
                w_even, w_odd = _fp4_halves(w2_ref, w2s_ref, expert, rows, kk, bk)
                return acc + _dot(a_even, w_even) + _dot(a_odd, w_odd)
            a = act_ref[pl.ds(first, bm), pl.ds(kk * bk, bk)]
            return acc + _dot(a, w2_ref[expert, rows, pl.ds(kk * bk, bk)])

        n_steps = act_ref.shape[1] // bk
        y = jax.lax.fori_loop(0, n_steps, step, jnp.zeros((bm, bn), jnp.float32))
        row_ok = jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 0) < count
        plt.store(y_ref.at[pl.ds(first, bm), pl.ds(n_block * bn, bn)], y, mask=row_ok)


def gate_up(
    plan, x: jax.Array, w1, w3, w1_scale: Optional[jax.Array], w3_scale: Optional[jax.Array], *,
    width: int, permute_out: bool, limit: float, cfg: KernelConfig, interpret: bool,
) -> jax.Array:
    """act [P + BM, F] bf16 for the expert-sorted pairs. x: [N, D] bf16 (chunk-reordered when fp4)."""
    fp4 = w1_scale is not None
    n_tiles = plan.tile_count.shape[0]
    rows_out = plan.pair_token.shape[0]
    weights = (w1, w1_scale, w3, w3_scale) if fp4 else (w1, w3)
    kernel = lambda *refs: _gate_up_kernel(
        *refs, fp4=fp4, permute_out=permute_out, cfg=cfg, limit=limit)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows_out, width), jnp.bfloat16),
        grid=(width // cfg.block_f, n_tiles),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=cfg.gate_up_warps, num_stages=cfg.gate_up_stages),
        name="moe_gate_up",
    )(plan.tile_expert, plan.tile_first, plan.tile_count, plan.pair_token, x, *weights)


def down(
    plan, act: jax.Array, w2, w2_scale: Optional[jax.Array], *, dim: int, cfg: KernelConfig,
    interpret: bool,
) -> jax.Array:
    """y [P + BM, D] f32 (unweighted expert outputs, pair order). act: [P + BM, F] bf16."""
    fp4 = w2_scale is not None
    n_tiles = plan.tile_count.shape[0]
    weights = (w2, w2_scale) if fp4 else (w2,)
    kernel = lambda *refs: _down_kernel(*refs, fp4=fp4, cfg=cfg)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((act.shape[0], dim), jnp.float32),
        grid=(dim // cfg.block_n, n_tiles),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=cfg.down_warps, num_stages=cfg.down_stages),
        name="moe_down",
    )(plan.tile_expert, plan.tile_first, plan.tile_count, act, *weights)
