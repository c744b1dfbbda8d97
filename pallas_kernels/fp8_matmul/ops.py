"""Public entry for the block-scaled fp8 matmul: ``fp8_matmul``, one signature over the registry's implementations
("xla" | "pallas", ``pallas_kernels.registry``), and the ``Fp8Weight`` pytree. The float64 ``reference.py`` is the
tests' oracle only."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp

from dsv41_jax.formats import BLOCK, decode_fp8, ue8m0_bytes
from pallas_kernels import registry
from pallas_kernels.fp8_matmul.kernel import fp8_matmul_pallas
from pallas_kernels.fp8_matmul.tiling import (  # noqa: F401 - DECODE_ROWS, SM_COUNT, _k_splits: re-exported
    DECODE_ROWS,
    DECODES,
    SCALE_BLOCK,
    SM_COUNT,
    KernelConfig,
    _k_splits,
    default_config,
)
from pallas_kernels.fp8_matmul.xla import fp8_matmul_xla

__all__ = ["IMPLS", "Fp8Weight", "KernelConfig", "check_offsets", "default_config", "fp8_matmul"]
IMPLS = registry.IMPLEMENTATIONS

ACTIVATION_DTYPES = (jnp.bfloat16, jnp.float32)
@dataclass(frozen=True)
class Fp8Weight:
    """A dense weight as the checkpoint stores it (MODEL.md §E.1): ``codes`` float8_e4m3fn [.., N, K] (N = out,
    K = in: ``y = x · Wᵀ``) and ``scales`` uint8 ue8m0 bytes [.., ⌈N/32⌉, ⌈K/32⌉], one per 32×32 block. Leading
    axes: a stack of layers (a scanned unit's), read at ``fp8_matmul(..., row=)``."""

    codes: jax.Array
    scales: jax.Array

    @classmethod
    def from_stored(cls, codes, scales) -> "Fp8Weight":
        """From the checkpoint's arrays: codes float8_e4m3fn or their raw bytes (uint8 / int8); scales ue8m0 bytes
        (uint8 or float8_e8m0fnu) or float powers of two."""
        codes = jnp.asarray(codes)
        if codes.dtype in (jnp.uint8, jnp.int8):
            codes = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
        if codes.dtype != jnp.float8_e4m3fn:
            raise ValueError(f"fp8 codes must be float8_e4m3fn or raw bytes, got {codes.dtype}")
        return cls(codes=codes, scales=ue8m0_bytes(scales))

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape [.., N, K]."""
        return tuple(self.codes.shape)

    def dequantized(self, dtype=jnp.bfloat16) -> jax.Array:
        """W [.., N, K] in ``dtype`` (exact in bf16 and f32)."""
        return decode_fp8(self.codes, self.scales, dtype)


jax.tree_util.register_dataclass(
    Fp8Weight, data_fields=[f.name for f in dataclasses.fields(Fp8Weight)], meta_fields=[])


def check_kernel_shapes(n: int, k: int, groups: int) -> None:
    """The Pallas path takes whole 16-row blocks of each group and whole 32-column scale blocks of K; other shapes
    (which the format admits, with partial edge blocks) go through the XLA implementation."""
    if n % groups or (n // groups) % 16 or k % SCALE_BLOCK:
        raise ValueError(
            f"the Pallas fp8 matmul needs each group's rows a multiple of 16 and K a multiple of {SCALE_BLOCK}; "
            f"got W [{n}, {k}] in {groups} group(s). Use impl='xla' for this shape")


def _check_config(cfg: KernelConfig, n: int, k: int, groups: int) -> None:
    blocks_ok = (cfg.block_m >= 16 and cfg.block_n >= 16 and (n // groups) % cfg.block_n == 0
                 and cfg.block_k % SCALE_BLOCK == 0 and cfg.k_splits >= 1 and k % (cfg.block_k * cfg.k_splits) == 0)
    if not blocks_ok:
        raise ValueError(f"{cfg} does not tile W [{n}, {k}] in {groups} group(s): block_m, block_n >= 16, block_n "
                         "dividing a group's rows, block_k a multiple of 32 with block_k * k_splits dividing K")
    if cfg.decode not in DECODES:
        raise ValueError(f"decode must be one of {DECODES}, got {cfg.decode!r}")


# The Pallas Triton lowering addresses an operand with 64-bit offsets only past 2**32 bytes and counts offsets in
# elements as signed int32 (see ``pallas_kernels.moe.ops.INT32_WRAP_BYTES``): one-byte codes of 2-4 GiB would wrap.
INT32_WRAP_BYTES = (2**31, 2**32)


def check_offsets(codes) -> None:
    """Refuse a stack of codes the Triton lowering would address past its end (2-4 GiB of one-byte codes; the
    release's largest dense stack, 12 layers of world 1's ``wq_b``, is 0.5 GB)."""
    size = math.prod(codes.shape)
    if INT32_WRAP_BYTES[0] <= size <= INT32_WRAP_BYTES[1]:
        raise ValueError(
            f"the Pallas fp8 matmul cannot address a {size / 2**30:.2f} GiB stack of codes {tuple(codes.shape)}: "
            "the Triton lowering's 32-bit offsets wrap between 2 and 4 GiB of one-byte elements. Use impl='xla'")


def _check(x: jax.Array, weight: Fp8Weight, groups: int, stacked: bool) -> tuple[int, int]:
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be bfloat16 or float32, got {x.dtype}")
    if weight.codes.ndim != (3 if stacked else 2):
        raise ValueError(f"codes {weight.shape} must be [N, K]" + (", a stack [L, N, K] with row" if stacked else
                                                                    " (a stack [L, N, K] needs row)"))
    n, k = weight.shape[-2:]
    lead = weight.shape[:-2]
    if weight.scales.shape != (*lead, -(-n // BLOCK), -(-k // BLOCK)):
        raise ValueError(f"scales {tuple(weight.scales.shape)} do not match codes {weight.shape} "
                         f"(one per {BLOCK}×{BLOCK} block)")
    if groups < 1 or n % groups:
        raise ValueError(f"groups = {groups} must divide N = {n}")
    if x.shape[-1] != groups * k:
        raise ValueError(f"x has {x.shape[-1]} columns; W [{n}, {k}] in {groups} group(s) needs {groups * k}")
    return n, k


def fp8_matmul(
    x: jax.Array,
    weight: Fp8Weight,
    *,
    groups: int = 1,
    out_dtype=None,
    row=None,
    impl: str = "pallas",
    interpret: Optional[bool] = None,
    config: Optional[KernelConfig] = None,
) -> jax.Array:
    """y [..., N] = x [..., G·K] · Wᵀ, W = dequant(weight) [N, K] (MODEL.md §E.1), f32 accumulation, y in
    ``out_dtype`` (default x's dtype: what ``model.norms.linear`` gives for a bf16 weight; float32 gives the
    accumulation itself, as ``linear_f32``).

    x: bfloat16 or float32, used as is (never rounded: the Pallas kernel splits an f32 x into exact bf16 pieces).
    groups: W holds G row blocks of N/G rows and block g multiplies x's columns g·K .. (g+1)·K (the grouped output
    projection ``wo_a``); 1 for a plain projection.
    row: with ``weight`` a stack of layers ([L, N, K] codes), the int32 index of this call's layer, read in place
    by the kernel (the XLA path selects the layer).
    impl: "pallas" (interpret defaults to True off GPU; W's groups in whole 16-row blocks and K in whole 32-column
    scale blocks, ``check_kernel_shapes``; ``config`` overrides ``default_config``) or "xla" (dequantise, then one
    dot; any shape the format admits); "reference" is a deprecated name of "xla".
    Results equal dequantise-then-matmul up to the order of the f32 summation (``reference.error_bound``).
    """
    impl = registry.resolve(impl)
    stacked = row is not None
    n, k = _check(x, weight, groups, stacked)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if impl == "xla":
        w = jax.tree.map(lambda a: a[row], weight) if stacked else weight
        return fp8_matmul_xla(x, w.codes, w.scales, groups=groups, out_dtype=out_dtype)
    check_kernel_shapes(n, k, groups)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if not interpret:
        check_offsets(weight.codes)
    lead = x.shape[:-1]
    rows = math.prod(lead)
    cfg = config or default_config(rows, n, k, groups)
    _check_config(cfg, n, k, groups)
    codes, scales = weight.codes, weight.scales
    if not stacked:
        codes, scales = codes[None], scales[None]
    layer = jnp.reshape(jnp.asarray(0 if row is None else row, jnp.int32), (1,))
    y = _pallas(x.reshape(rows, x.shape[-1]), codes, scales, layer, groups=groups, out_dtype=out_dtype, cfg=cfg,
                interpret=interpret)
    return y.reshape(*lead, n)


@functools.partial(jax.jit, static_argnames=("groups", "out_dtype", "cfg", "interpret"))
def _pallas(x, codes, scales, layer, *, groups: int, out_dtype, cfg: KernelConfig, interpret: bool):
    """The Pallas path as one jitted function (every call site of one shape traces and lowers the kernel once):
    the kernel, the K splits' partial sums added (as elementwise adds, which XLA fuses into y's consumer), the
    padding rows dropped. One device kernel a call without a K split."""
    rows = x.shape[0]
    if interpret:  # interpret mode reads whole blocks: x padded to them (a GPU masks the rows instead)
        x = jnp.pad(x, ((0, -rows % cfg.block_m), (0, 0)))
    if cfg.decode == "alu":
        codes = jax.lax.bitcast_convert_type(codes, jnp.uint8)
    out = fp8_matmul_pallas(x, codes, scales, layer, rows=rows, groups=groups, out_dtype=out_dtype, cfg=cfg,
                            interpret=interpret)
    out = out[:, :rows]
    y = out[0]
    for split in range(1, cfg.k_splits):  # in split order (a fixed summation order)
        y = y + out[split]
    return y.astype(out_dtype)
