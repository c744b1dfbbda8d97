"""Public entry for the routed experts: ``routed_experts``, one signature over the registry's implementations
("xla" | "pallas", ``pallas_kernels.registry``), and the ``ExpertWeights`` pytree. The gather ``reference.py`` is
the tests' oracle only."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp

from dsv41_jax.formats import BLOCK, GEMM_INPUTS, decode_fp4, fake_quant_fp8, ue8m0_bytes
from pallas_kernels import registry
from pallas_kernels.moe import kernel as moe_kernel
from pallas_kernels.moe.grouping import DECODE_BLOCK_M, default_block_m, plan_tiles
from pallas_kernels.moe.xla import clamped_swiglu, routed_experts_xla

__all__ = ["GEMM_INPUTS", "IMPLS", "ExpertWeights", "as_words", "check_blocks", "check_offsets", "clamped_swiglu",
           "default_config", "plane_chunks", "routed_experts", "weighted_gather_sum"]
IMPLS = registry.IMPLEMENTATIONS


@dataclass(frozen=True)
class ExpertWeights:
    """The routed experts of one layer (this rank's slice of the intermediate width F).

    float form: w1, w3 [E, F, D] (gate, up), w2 [E, D, F] (down), bf16 for the kernel (any float dtype on the
    XLA path); the scales are None.
    fp4 form (MODEL.md §E.1): w1, w3 uint8 [E, F, D/2], w2 uint8 [E, D, F/2] packed e2m1 codes (low
    nibble = even column) with ue8m0 scales w1_scale, w3_scale uint8 [E, F, D/32], w2_scale [E, D, F/32].
    """

    w1: jax.Array
    w3: jax.Array
    w2: jax.Array
    w1_scale: Optional[jax.Array] = None
    w3_scale: Optional[jax.Array] = None
    w2_scale: Optional[jax.Array] = None

    @classmethod
    def from_fp4(cls, w1, w1_scale, w3, w3_scale, w2, w2_scale) -> "ExpertWeights":
        """From the checkpoint's packed arrays: codes int8/uint8, scales ue8m0 bytes (uint8 or
        float8_e8m0fnu) or float powers of two."""
        return cls(
            w1=_as_codes(w1), w3=_as_codes(w3), w2=_as_codes(w2),
            w1_scale=ue8m0_bytes(w1_scale), w3_scale=ue8m0_bytes(w3_scale), w2_scale=ue8m0_bytes(w2_scale),
        )

    @property
    def is_fp4(self) -> bool:
        return self.w1_scale is not None

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def dim(self) -> int:
        """Model width D."""
        return self.w2.shape[1]

    @property
    def width(self) -> int:
        """Intermediate width F of this rank."""
        return self.w1.shape[1]

    def dequantized(self, dtype=jnp.bfloat16) -> "ExpertWeights":
        """The float form: fp4 decoded in ``dtype`` (exact in bf16 and f32); a float form as it is."""
        if not self.is_fp4:
            return self
        return ExpertWeights(
            w1=decode_fp4(self.w1, self.w1_scale, dtype),
            w3=decode_fp4(self.w3, self.w3_scale, dtype),
            w2=decode_fp4(self.w2, self.w2_scale, dtype),
        )


jax.tree_util.register_dataclass(
    ExpertWeights,
    data_fields=[f.name for f in dataclasses.fields(ExpertWeights)],
    meta_fields=[],
)


def _as_codes(codes) -> jax.Array:
    codes = jnp.asarray(codes)
    if codes.dtype == jnp.int8:
        return jax.lax.bitcast_convert_type(codes, jnp.uint8)
    if codes.dtype != jnp.uint8:
        raise ValueError(f"fp4 codes must be int8 or uint8, got {codes.dtype}")
    return codes


def _largest_block(size: int, candidates: tuple[int, ...], what: str) -> int:
    for block in candidates:
        if size % block == 0:
            return block
    raise ValueError(f"{what} = {size} must be a multiple of {candidates[-1]}")


FP4_K_MULTIPLE = 64  # fp4 K chunks: four planes of 16+ columns (a GPU dot's least K), whole scale groups


def default_config(num_pairs: int, weights: ExpertWeights, block_m: int | None = None) -> moe_kernel.KernelConfig:
    """Block sizes for this shape: BM by the mean rows per expert (at most ``block_m``, the plan's BM of a
    prefill-sized block, PLANNER.md §E), the rest the largest that divide.

    bf16 prefill-sized tiles (BM 64) of an F that 128 divides compute 128 act columns a program from 64-wide K
    chunks, 4 stages: half the programs, so each gathered x row is read half as often (measured: see
    docs/BENCHMARKS.md, section "The maximum context with the Mosaic pass; routed experts at prefill sizes; norms
    without a barrier"); other widths stream 128-wide K chunks (3 stages) into 64 columns. fp4 tiles above decode
    size take the dequantised weights as the GEMMs' first operand (``fp4_weights_first``: Hopper's wgmma takes its
    first operand from registers, where the decoded tile is) with 64 act columns from 128-wide K chunks, 3 stages,
    and ``down`` steps over 128-wide F chunks where 128 divides F, 3 stages (measured: see docs/BENCHMARKS.md,
    sections "fp4 experts: the weights as the first operand" and "fp4 experts: one accumulator; the MoE plan as a
    counting sort").
    Decode-sized tiles (BM 16: under 4 rows an expert) stream 256-wide K chunks in both formats: each program
    then has twice to four times the bytes in flight per step, which is what a tile of one or two rows lacks
    (measured: see docs/BENCHMARKS.md, section "Routed experts at decode sizes").
    """
    def k_chunk(size: int, candidates: tuple[int, ...], what: str) -> int:
        fits = tuple(c for c in candidates if c % FP4_K_MULTIPLE == 0 or not weights.is_fp4)
        return _largest_block(size, fits, what)

    block_m = min(default_block_m(num_pairs, weights.num_experts), block_m or 64)
    block_f = k_chunk(weights.width, (64, 32), "expert width F")
    block_n = _largest_block(weights.dim, (128, 64, 32), "model width D")
    if block_m == DECODE_BLOCK_M:
        return moe_kernel.KernelConfig(
            block_m=block_m, block_f=block_f, block_n=block_n, gate_up_stages=3,
            block_k=k_chunk(weights.dim, (256, 128, 64, 32), "model width D"))
    if weights.is_fp4:
        return moe_kernel.KernelConfig(
            block_m=block_m, block_f=block_f, block_n=block_n, gate_up_stages=3, down_stages=3,
            fp4_weights_first=True, block_k=k_chunk(weights.dim, (128, 64), "model width D"),
            down_block_k=k_chunk(weights.width, (128, 64), "expert width F"))
    if block_m == 64 and weights.width % 128 == 0:  # down then asks (64·128 + 128·128)·2 B × 4 = 192 KB of smem
        return moe_kernel.KernelConfig(
            block_m=block_m, block_f=128, block_n=block_n, gate_up_stages=4,
            block_k=k_chunk(weights.dim, (64, 32), "model width D"))
    return moe_kernel.KernelConfig(
        block_m=block_m, block_f=block_f, block_n=block_n, gate_up_stages=3,
        block_k=_largest_block(weights.dim, (128, 64, 32), "model width D"))


def plane_chunks(x: jax.Array, chunk: int) -> jax.Array:
    """x [N, D] with each chunk of ``chunk`` columns in plane order: columns ≡ 0, 1, 2, 3 mod 4 (``kernel``)."""
    n, d = x.shape
    return x.reshape(n, d // chunk, chunk // 4, 4).swapaxes(2, 3).reshape(n, d)


def as_words(weights: ExpertWeights) -> ExpertWeights:
    """fp4 experts with their code bytes [..., C/2] seen as 16-bit words [..., C/4] (four codes each, the first in
    the low nibble of the low byte): the kernels' view (``kernel``: words are addressed without wrapping)."""
    def words(codes):
        return jax.lax.bitcast_convert_type(codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2), jnp.uint16)
    return dataclasses.replace(weights, w1=words(weights.w1), w3=words(weights.w3), w2=words(weights.w2))


def _check_shapes(x, topk_ids, topk_weights, weights: ExpertWeights) -> None:
    n, d = x.shape
    if topk_ids.ndim != 2 or topk_ids.shape[0] != n or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids {topk_ids.shape} and topk_weights {topk_weights.shape} must both be [N={n}, k]")
    if weights.dim != d:
        raise ValueError(f"x has D = {d} but w2 has D = {weights.dim}")
    pack = 2 if weights.is_fp4 else 1
    e, f = weights.num_experts, weights.width
    expect = {"w1": (e, f, d // pack), "w3": (e, f, d // pack), "w2": (e, d, f // pack)}
    for name, shape in expect.items():
        if getattr(weights, name).shape != shape:
            raise ValueError(f"{name} has shape {getattr(weights, name).shape}, expected {shape}")


# The Pallas Triton lowering addresses an operand with 64-bit offsets only past 2**32 bytes (jax 0.10.2 / 0.11.2,
# ``_compute_offsets_from_indices``) and counts its offsets in elements as signed int32: an operand of one-byte
# elements of 2-4 GiB wraps and reads outside itself (CUDA_ERROR_ILLEGAL_ADDRESS on a GPU).
INT32_WRAP_BYTES = (2**31, 2**32)


def check_offsets(weights: ExpertWeights) -> None:
    """Refuse expert operands the Triton lowering would address past their end (``INT32_WRAP_BYTES``): the kernels
    see fp4 codes as 16-bit words, which never wrap, so only a one-byte scale operand of 2-4 GiB could (a stack of
    32-64 GiB of codes on one rank)."""
    codes = ("w1", "w3", "w2") if weights.is_fp4 else ()  # read as 16-bit words (``as_words``): never wrap
    for name in ("w1", "w3", "w2", "w1_scale", "w3_scale", "w2_scale"):
        array = getattr(weights, name)
        if array is None or name in codes:
            continue
        if array.dtype.itemsize == 1 and INT32_WRAP_BYTES[0] <= array.size <= INT32_WRAP_BYTES[1]:
            raise ValueError(
                f"the Pallas MoE kernel cannot address {name} of {array.size * array.dtype.itemsize / 2**30:.2f} "
                f"GiB on this rank {tuple(array.shape)}: the Triton lowering's 32-bit offsets wrap between 2 and 4 "
                "GiB of one-byte elements. Split the experts over more devices or use --impl xla")


def routed_experts(
    x: jax.Array,
    topk_ids: jax.Array,
    topk_weights: jax.Array,
    weights: ExpertWeights,
    *,
    swiglu_limit: float,
    impl: str = "pallas",
    interpret: Optional[bool] = None,
    config: Optional[moe_kernel.KernelConfig] = None,
    block_m: Optional[int] = None,
    row: Optional[jax.Array] = None,
    gemm_inputs: str = "exact",
) -> jax.Array:
    """y [N, D] f32 = sum_j w[n, j] * (bf16(act) . w2[e_nj]^T) (MODEL.md §B.10, PLANNER.md §E).

    x: [N, D]; topk_ids: [N, k] int32 (ids outside [0, E) contribute nothing); topk_weights: [N, k] f32;
    act = silu(min(g, lim)) * clip(u, -lim, lim), g = x.w1^T, u = x.w3^T in f32.
    impl: "pallas" (the kernel: x cast to bf16, f32 per-pair products; interpret defaults to True off GPU;
    refuses operands its addressing would wrap, ``check_offsets``) or "xla" (grouped matmuls in x's dtype with
    g, u, act and each pair's w2 product rounded to it, as mlx-lm; fp4 decoded in it; ``config`` and
    ``interpret`` unused); "reference" is a deprecated name of "xla". ``block_m``: the plan's pairs per tile for
    prefill-sized blocks (``default_config``; ignored with an explicit ``config``).
    row: with ``weights`` the experts of a stack of layers (every field [L, E, ...], a scanned unit's
    parameters), the int32 scalar index of this call's layer. The kernel reads that layer's experts in place
    (the stack seen as [L·E, ...], expert e of the layer at row·E + e): selecting the layer first would copy
    all its E experts every call (docs/DESIGN.md "Scanned layers"). The XLA path selects the layer.
    gemm_inputs: "exact" (the above) or "fp8", the release's GEMM inputs: x rounded to e4m3 with a ue8m0 scale per
    32 columns (in its dtype) before both GEMMs, and the down projection's input fp8(dtype(w[n, j] · act)) — the
    pair's weight applied before w2 in f32, rounded to the act dtype (x's; the kernel's bf16 for a bf16 x), then
    to fp8 per 32 columns of F — so y = sum_j (that . w2[e_nj]^T) (as mlx-vlm's ``deepseek_v41``). F must be a
    multiple of 32 (a rank's F: its blocks are the unsharded ones when every rank's width is).
    """
    impl = registry.resolve(impl)
    if gemm_inputs not in GEMM_INPUTS:
        raise ValueError(f"gemm_inputs {gemm_inputs!r} must be one of {GEMM_INPUTS}")
    stacked = row is not None
    layer = _layer_shapes(weights) if stacked else weights
    _check_shapes(x, topk_ids, topk_weights, layer)
    if gemm_inputs == "fp8" and layer.width % BLOCK:
        raise ValueError(f"fp8 GEMM inputs round act in blocks of {BLOCK} columns: the expert width F = "
                         f"{layer.width} is not a multiple of {BLOCK}")
    if impl == "xla":
        w = (layer_of(weights, row) if stacked else weights).dequantized(x.dtype)
        return routed_experts_xla(x, topk_ids, topk_weights, w.w1, w.w3, w.w2, swiglu_limit=swiglu_limit,
                                  gemm_inputs=gemm_inputs)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if layer.is_fp4 and layer.width % FP4_K_MULTIPLE:
        weights = _padded_width(weights, FP4_K_MULTIPLE)
        layer = _layer_shapes(weights) if stacked else weights
    flat, first = weights, jnp.zeros((), jnp.int32)
    if stacked:  # the stack seen as [L·E, ...], read in place from the layer's first expert row·E
        flat, first = _layers_as_experts(weights), jnp.asarray(row, jnp.int32) * layer.num_experts
    if not interpret:
        check_offsets(flat)
    num_pairs = topk_ids.size
    cfg = config or default_config(num_pairs, layer, block_m)
    check_blocks(cfg, layer)
    return _routed_pallas(x, topk_ids, topk_weights, flat, first, num_experts=layer.num_experts,
                          swiglu_limit=float(swiglu_limit), cfg=cfg, interpret=interpret, gemm_inputs=gemm_inputs)


def _padded_width(weights: ExpertWeights, multiple: int) -> ExpertWeights:
    """fp4 experts (one layer's or a stack's) with the width F zero-padded to a multiple of ``multiple``, a copy
    made per call: only a toy model's narrow shard needs it (the tiny config at world 8 has 32 columns a rank; the
    release's widths are multiples of 64 at every world). Zero codes are zero weights, so the padded gate/up rows
    give act 0 and the padded down columns add nothing (the argument of ``sharding/layout.py``)."""
    extra = -weights.w1.shape[-2] % multiple

    def pad(a, axis: int, n: int):
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, n)
        return jnp.pad(a, widths)

    return ExpertWeights(w1=pad(weights.w1, -2, extra), w3=pad(weights.w3, -2, extra),
                         w2=pad(weights.w2, -1, extra // 2), w1_scale=pad(weights.w1_scale, -2, extra),
                         w3_scale=pad(weights.w3_scale, -2, extra), w2_scale=pad(weights.w2_scale, -1, extra // 32))


def layer_of(weights: ExpertWeights, row) -> ExpertWeights:
    """Layer ``row`` of a stack of layers' experts (every field [L, E, ...]); a copy when ``row`` is traced."""
    return jax.tree.map(lambda a: a[row], weights)


def _layer_shapes(weights: ExpertWeights) -> ExpertWeights:
    """One layer's shapes of a stack of layers' experts (``jax.ShapeDtypeStruct`` fields, for the checks)."""
    if weights.w1.ndim != 4:
        raise ValueError(f"row is given but w1 {tuple(weights.w1.shape)} is not a stack of layers [L, E, F, ·]")
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), weights)


def _layers_as_experts(weights: ExpertWeights) -> ExpertWeights:
    """A stack [L, E, ...] as L·E experts [L·E, ...] (a reshape of contiguous leading dims: no copy)."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), weights)


@functools.partial(jax.jit, static_argnames=("num_experts", "swiglu_limit", "cfg", "interpret", "gemm_inputs"))
def _routed_pallas(x, topk_ids, topk_weights, weights: ExpertWeights, first_expert, *, num_experts: int,
                   swiglu_limit: float, cfg: moe_kernel.KernelConfig, interpret: bool,
                   gemm_inputs: str = "exact") -> jax.Array:
    """The Pallas path's device work as one jitted function: every layer calls it with the same shapes, so a
    model program traces and lowers it once (12 calls a 40-layer decode step, each of which would otherwise
    lower its Triton kernels again: measured, see docs/BENCHMARKS.md, section "Lowering for CUDA on the CPU
    host"). ``weights`` hold ``num_experts`` experts from
    ``first_expert`` on (int32 scalar; a stack of layers' experts: the layer's first): the plan is the layer's,
    its tiles point into the stack.

    fp8 GEMM inputs: x rounded in its dtype (then exact in bf16); ``gate_up`` applies each pair's weight to act
    and stores it in x's dtype; the fp8 rounding of that act is one XLA pass between the two kernels
    (``_round_act``); the combine is then unweighted."""
    fp8 = gemm_inputs == "fp8"
    plan = plan_tiles(topk_ids, num_experts, cfg.block_m)
    plan = dataclasses.replace(plan, tile_expert=plan.tile_expert + first_expert)
    pair_weights, act_dtype = None, jnp.bfloat16
    if fp8:
        pair_weights, act_dtype = _sorted_pair_weights(plan, topk_weights), x.dtype
        x = fake_quant_fp8(x)
    x = x.astype(jnp.bfloat16)
    if weights.is_fp4:
        x, weights = plane_chunks(x, cfg.block_k), as_words(weights)
    act = moe_kernel.gate_up(
        plan, x, weights.w1, weights.w3, weights.w1_scale, weights.w3_scale,
        width=weights.width, permute_out=weights.is_fp4, limit=swiglu_limit, cfg=cfg,
        interpret=interpret, pair_weights=pair_weights, act_dtype=act_dtype)
    if fp8:
        act = _round_act(act, cfg.down_chunk, planes=weights.is_fp4).astype(jnp.bfloat16)
    y_pairs = moe_kernel.down(
        plan, act, weights.w2, weights.w2_scale, dim=weights.dim, cfg=cfg, interpret=interpret)
    combine = jnp.ones_like(topk_weights) if fp8 else topk_weights  # fp8: the weights are in act already
    return weighted_gather_sum(y_pairs, plan.pair_pos, plan.pair_valid, combine)


def _sorted_pair_weights(plan, topk_weights) -> jax.Array:
    """f32 [P + BM]: each pair's routing weight at its expert-sorted slot (``plan.pair_token``'s order), 0 for
    dropped pairs and the padding slots (what ``gate_up`` multiplies act by with fp8 GEMM inputs)."""
    w = jnp.where(plan.pair_valid, topk_weights.astype(jnp.float32), 0.0).reshape(-1)
    slots = jnp.zeros(plan.pair_token.shape, jnp.float32)
    return slots.at[plan.pair_pos.reshape(-1)].set(w)  # dropped pairs all write 0 at slot P


def _round_act(act: jax.Array, chunk: int, *, planes: bool) -> jax.Array:
    """``formats.fake_quant_fp8`` of act [R, F] in blocks of 32 act columns. ``planes`` (fp4 experts): each
    ``chunk`` of stored columns is in plane order (``gate_up``'s ``permute_out``: stored position p holds column
    4·(p mod chunk/4) + p div (chunk/4)), so block b of a chunk is the positions whose p mod chunk/4 is in
    [8b, 8b + 8): [4 planes, 8] of them, rounded together, stored back in place."""
    if not planes:
        return fake_quant_fp8(act)
    r, f = act.shape
    q = chunk // 4
    blocks = act.reshape(r, f // chunk, 4, q // 8, 8).swapaxes(2, 3)  # [R, F/chunk, q/8 blocks, 4 planes, 8]
    rounded = fake_quant_fp8(blocks.reshape(r, f // chunk, q // 8, 32))
    return rounded.reshape(r, f // chunk, q // 8, 4, 8).swapaxes(2, 3).reshape(r, f)


def check_blocks(cfg: moe_kernel.KernelConfig, weights: ExpertWeights) -> None:
    """The kernels' grids cover F / BF and D / BN blocks and step over D / BK chunks: a block that does not
    divide its width would leave columns uncomputed (silently wrong output). fp4
    K chunks (BK for gate_up, ``down_chunk`` for down) are multiples of 64: four planes of 16+ columns (a GPU dot's
    least K) of whole groups of 32 codes sharing one scale."""
    for what, size, block in (("expert width F", weights.width, cfg.block_f),
                              ("expert width F", weights.width, cfg.down_chunk),
                              ("model width D", weights.dim, cfg.block_n),
                              ("model width D", weights.dim, cfg.block_k)):
        if size % block:
            raise ValueError(f"{what} = {size} is not a multiple of the block {block} ({cfg})")
    if weights.is_fp4 and any(b % FP4_K_MULTIPLE for b in (cfg.block_k, cfg.block_f, cfg.down_chunk)):
        raise ValueError(f"fp4 experts need block_k, block_f and down_block_k multiples of 64 (four planes of 16+ "
                         f"columns, whole scale groups), got {cfg}")


def weighted_gather_sum(y_pairs, pair_pos, pair_valid, topk_weights) -> jax.Array:
    """y[n] = sum_j w[n, j] * y_pairs[pos(n, j)], slots added in order j = 0..k-1 (PLANNER.md §E step 6)."""
    n, k = pair_pos.shape
    y = jnp.zeros((n, y_pairs.shape[1]), jnp.float32)
    for j in range(k):
        term = topk_weights[:, j, None].astype(jnp.float32) * y_pairs[pair_pos[:, j]]
        y = y + jnp.where(pair_valid[:, j, None], term, 0.0)
    return y
