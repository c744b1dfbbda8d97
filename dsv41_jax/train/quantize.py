"""Quantisation-aware training: every weight seen by the forward is the value it will have once stored in the
release format (`make_tiny.storage_kinds` under ``fp4``: dense matrices fp8 with 32×32 ue8m0 scales, routed
experts fp4 with per-32 ue8m0 scales, the rest bf16 or f32; engram tables fp8 rows), with a straight-through
gradient. The roundings are the codec's (`dsv41_jax.formats`): the exported checkpoint holds exactly the weights
the last training step saw."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import param_specs
from ..config import ModelConfig
from ..formats import BLOCK, FP4_MAX, FP8_MAX, pow2_ceil, round_e2m1, round_to_e4m3
from ..make_tiny import storage_kinds

_TINY = 2.0**-126  # an all-zero block's amax: any positive scale gives zero codes


def _ste(w: jax.Array, q: jax.Array) -> jax.Array:
    """q forward, the identity's gradient backward."""
    return w + jax.lax.stop_gradient(q - w)


def fp8_blocks(w: jax.Array) -> jax.Array:
    """w [.., O, I] (O, I multiples of 32) → its fp8 value: e4m3 with one ue8m0 scale per 32×32 block (§E.1)."""
    *lead, o, i = w.shape
    b = w.reshape(*lead, o // BLOCK, BLOCK, i // BLOCK, BLOCK)
    amax = jnp.maximum(jnp.max(jnp.abs(b), axis=(-3, -1), keepdims=True), _TINY)
    step = pow2_ceil(amax / FP8_MAX)
    return (round_to_e4m3(jnp.clip(b / step, -FP8_MAX, FP8_MAX)) * step).reshape(w.shape)


def _per_32(w: jax.Array, qmax: float, rounding) -> jax.Array:
    g = w.reshape(*w.shape[:-1], -1, BLOCK)
    amax = jnp.maximum(jnp.max(jnp.abs(g), axis=-1, keepdims=True), _TINY)
    step = pow2_ceil(amax / qmax)
    return (rounding(jnp.clip(g / step, -qmax, qmax)) * step).reshape(w.shape)


def fp4_rows(w: jax.Array) -> jax.Array:
    """w [.., O, I] → its fp4 value: e2m1 with one ue8m0 scale per row and 32 inputs (§E.1)."""
    return _per_32(w, FP4_MAX, round_e2m1)


def fp8_rows(w: jax.Array) -> jax.Array:
    """An engram table [R, d] → its fp8-rows value: e4m3 with one ue8m0 scale per row and 32 dims (§B.12)."""
    return _per_32(w, FP8_MAX, round_to_e4m3)


def bf16(w: jax.Array) -> jax.Array:
    return w.astype(jnp.bfloat16).astype(jnp.float32)


ROUNDINGS = {"fp8": fp8_blocks, "fp4": fp4_rows, "bf16": bf16, param_specs.TABLE_KIND: fp8_rows}


def model_kinds(cfg: ModelConfig) -> dict[str, str]:
    """Model name → storage kind of every parameter of the release layout, the DSpark stages' included."""
    return {param_specs.model_name(official): kind
            for official, kind in storage_kinds(cfg, "fp4", dspark=True).items()}


def as_stored(name: str, w: jax.Array, kinds: dict[str, str]) -> jax.Array:
    """``w`` as ``kinds[name]`` stores it, straight-through (f32 and unknown names: unchanged)."""
    rounding = ROUNDINGS.get(kinds.get(name, "f32"))
    return w if rounding is None else _ste(w, rounding(w))
