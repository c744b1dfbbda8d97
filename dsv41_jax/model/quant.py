"""Fake-quantization rounding points of the official cache formats (`MODEL.md` §C.2), and the fp8 GEMM inputs of
``ModelOptions.gemm_inputs="fp8"`` (``round_gemm_input``).

Each function quantizes a tensor blockwise along its last axis and immediately dequantizes it, returning the
input dtype. As in mlx-lm, a tensor whose last dim is not a multiple of the block is returned unrounded.
The e4m3 / e2m1 roundings themselves are the codec module's (``dsv41_jax.formats``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .. import formats
from ..formats import FP4_MAX, GEMM_INPUTS, pow2_ceil, round_e2m1, round_to_e4m3  # the codecs (§C.1)


def _blocks(x: jnp.ndarray, block: int) -> jnp.ndarray:
    """x [..., n] -> f32 [..., n/block, block]."""
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


# The rounding points are jitted: the layers call them alike, so a program traces and lowers each once a shape.
@functools.partial(jax.jit, static_argnames="block")
def fake_quant_fp8(x: jnp.ndarray, block: int = 32) -> jnp.ndarray:
    """e4m3 values with a power-of-two scale per block of ``block`` (rounding point #1: window KV; the fp8 GEMM
    inputs, ``round_gemm_input``): the codec's ``formats.fake_quant_fp8``, jitted."""
    return formats.fake_quant_fp8(x, block)


@functools.partial(jax.jit, static_argnames=("block", "e4m3_scale"))
def fake_quant_fp4(x: jnp.ndarray, block: int, e4m3_scale: bool = False) -> jnp.ndarray:
    """e2m1 values with one scale per block of ``block``.

    ``e4m3_scale``: the scale is ``e4m3(amax/6)`` (rounding point #2: compressed KV, block 16); otherwise a power
    of two ``2^ceil(log2(amax/6))`` (points #3/#4: index keys and index queries, block 32).
    """
    if x.shape[-1] % block:
        return x
    v = _blocks(x, block)
    floor = FP4_MAX * 2.0**-9 if e4m3_scale else FP4_MAX * 2.0**-126
    amax = jnp.maximum(jnp.max(jnp.abs(v), axis=-1, keepdims=True), floor)
    if e4m3_scale:
        scale = round_to_e4m3(amax / FP4_MAX)
    else:
        scale = pow2_ceil(amax / FP4_MAX)
    y = round_e2m1(jnp.clip(v / scale, -FP4_MAX, FP4_MAX))
    return (y * scale).reshape(x.shape).astype(x.dtype)


def round_window_kv(x: jnp.ndarray, enabled: bool) -> jnp.ndarray:
    """Point #1: fp8 window KV rows [.., head_dim]."""
    return fake_quant_fp8(x, 32) if enabled else x


def round_compressed_kv(x: jnp.ndarray, enabled: bool) -> jnp.ndarray:
    """Point #2: fp4 compressed entries [.., head_dim] with e4m3 scales per 16."""
    return fake_quant_fp4(x, 16, e4m3_scale=True) if enabled else x


def round_index(x: jnp.ndarray, enabled: bool) -> jnp.ndarray:
    """Points #3 and #4: fp4 index keys / queries [.., index_head_dim] with power-of-two scales per 32."""
    return fake_quant_fp4(x, 32) if enabled else x


def round_gemm_input(x: jnp.ndarray, mode: str) -> jnp.ndarray:
    """A GEMM input [.., K] as the mode has it (``ModelOptions.gemm_inputs``): "exact" as it is; "fp8" rounded to
    e4m3 with a power-of-two (ue8m0) scale per 32 along K and back, in x's dtype — the activations DeepSeek's own
    inference feeds its fp8 / fp4 GEMMs (mlx-vlm's ``fake_quant_fp8_ue8m0``; `MODEL.md` §C.2)."""
    if mode == "exact":
        return x
    if mode != "fp8":
        raise ValueError(f"gemm_inputs {mode!r} must be one of {GEMM_INPUTS}")
    return fake_quant_fp8(x, 32)
