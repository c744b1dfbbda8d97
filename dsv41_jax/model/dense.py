"""The dense projections the release stores in fp8 (`param_specs.is_fp8_dense`): held in the model dtype
(``Linear``, dequantised by the loader) or as stored (``Fp8Linear``: e4m3 codes + one ue8m0 byte per 32×32
block, MODEL.md §E.1), computed by the block-scaled fp8 matmul op (``pallas_kernels/fp8_matmul``) through its
sharding wrapper. ``Dense`` says which; every module that owns such a projection builds it with ``Dense.linear``.

Both compute the same products: the op's XLA implementation is the dequantised weight in the activations' dtype
and one dot with f32 accumulation, which is ``norms.linear``; the Pallas kernel differs from it only in the order
of the f32 sums (``pallas_kernels/fp8_matmul/reference.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.fp8_matmul.ops import Fp8Weight
from sharding.kernels import fp8_matmul as sharded_fp8_matmul

from ..formats import BLOCK
from .norms import HIGHEST, Linear

FORMATS = ("dequantized", "fp8")


@dataclass(frozen=True)
class Dense:
    """``format``: "dequantized" (the weight in the model dtype) or "fp8" (as stored); ``impl``: the fp8 op's
    implementation ("xla" | "pallas", ``pallas_kernels.registry``)."""

    format: str = "dequantized"
    impl: str = "xla"

    def linear(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs, rule: str):
        """The projection ``weight [out, in]``: a ``Linear`` or an ``Fp8Linear``. ``rule``: the model name (any
        layer's, without ``.weight``) whose sharding rule the weight follows, e.g. ``"layers.0.attn.wq_b"``."""
        if self.format == "fp8":
            return Fp8Linear(in_features, out_features, dtype=dtype, rngs=rngs, impl=self.impl, rule=rule)
        return Linear(in_features, out_features, dtype=dtype, rngs=rngs)


class Fp8Param(nnx.Param):
    """An fp8 dense weight's codes or scale bytes. In a scanned unit they stay the unit's whole stack [n, ...],
    read in place at the layer's row by the op (``transformer._split_routed``): a loop-sliced layer handed to the
    Pallas kernel would be a copy of the layer's weights every step."""


class Fp8Linear(nnx.Module):
    """``weight`` float8_e4m3fn [out, in] and ``scale`` uint8 ue8m0 bytes [⌈out/32⌉, ⌈in/32⌉], as the checkpoint
    stores them (a scanned unit's: stacked [n, ...], read at ``row``); y = x · dequant(weight, scale)ᵀ in the
    promoted dtype of x and the model dtype (what ``Linear`` gives for the dequantised weight)."""

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs, impl: str, rule: str):
        self.dtype = jnp.dtype(dtype)
        self.impl = impl
        self.rule = rule
        # random init: codes ~ N(0, 64²) in e4m3, one scale 2^-round(log2(64·√in)): values of std ~ 1/√in
        codes = jax.random.normal(rngs.params(), (out_features, in_features), jnp.float32) * 64.0
        self.weight = Fp8Param(jnp.clip(codes, -448.0, 448.0).astype(jnp.float8_e4m3fn))
        byte = 127 - round(math.log2(64.0 * math.sqrt(in_features)))
        self.scale = Fp8Param(jnp.full((-(-out_features // BLOCK), -(-in_features // BLOCK)), byte, jnp.uint8))

    def stored(self) -> Fp8Weight:
        return Fp8Weight(self.weight[...], self.scale[...])

    def __call__(self, x: jnp.ndarray, row=None) -> jnp.ndarray:
        return self.grouped(x, 1, row)

    def grouped(self, x: jnp.ndarray, groups: int, row=None) -> jnp.ndarray:
        """x [..., G·K] → [..., N]: row block g of W (N/G rows) against x's columns g·K .. (g+1)·K (``groups`` =
        G; 1 for a plain projection), in the promoted dtype of x and the model dtype. ``row``: the layer's row
        when the weight is its unit's stack (int32 scalar), else unused."""
        stacked = {"row": row} if self.weight[...].ndim == 3 else {}
        return sharded_fp8_matmul(x, self.stored(), rule=self.rule, groups=groups,
                                  out_dtype=jnp.promote_types(x.dtype, self.dtype), impl=self.impl, **stacked)


def grouped_linear(layer, x: jnp.ndarray, groups: int, row=None) -> jnp.ndarray:
    """``layer`` (a ``Linear`` or an ``Fp8Linear`` of W [N, K]) applied per group: x [..., G·K] → [..., N] in x's
    dtype, group g's rows of W against its columns of x (the grouped output projection ``wo_a``, MODEL.md §B.6).
    ``row``: as ``Fp8Linear.grouped``."""
    if isinstance(layer, Fp8Linear):
        return layer.grouped(x, groups, row).astype(x.dtype)
    w = layer.weight[...]
    xg = x.reshape(*x.shape[:-1], groups, -1)
    z = jnp.einsum("...gi,goi->...go", xg, w.reshape(groups, -1, w.shape[-1]).astype(x.dtype),
                   preferred_element_type=jnp.float32, precision=HIGHEST).astype(x.dtype)
    return z.reshape(*x.shape[:-1], -1)
