"""Hyper-connections: the per-sublayer mix with Sinkhorn, collapse and expand (`MODEL.md` §B.3, §B.4).

V4.1's lagged ("single-pass") pre: the pre computed at a sublayer collapses the *next* sublayer's input; the
caller threads it through (`transformer.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.hc_mix.ops import comb as comb_op
from sharding.kernels import hc_comb

from .norms import f32_matmul, random_normal, rms_scale


def mix_params(cfg, rngs: nnx.Rngs) -> tuple[nnx.Param, nnx.Param, nnx.Param]:
    """One HC mix's parameters (§B.3): fn f32 [(2+S)·S, S·D], base f32 [(2+S)·S], scale f32 [3] (pre, post, comb);
    a layer (and a DSpark stage) declares two, ``hc_attn_*`` and ``hc_ffn_*``."""
    mix, width = cfg.hc_mix_width, cfg.hc_mult * cfg.hidden_size
    return (nnx.Param(random_normal(rngs, (mix, width), width**-0.5, jnp.float32)),
            nnx.Param(jnp.zeros((mix,), jnp.float32)), nnx.Param(jnp.ones((3,), jnp.float32)))


def mix_kwargs(cfg, impl: str) -> dict:
    """The static arguments of ``hc_mix`` for ``cfg`` (eps, Sinkhorn iterations) and the op's implementation."""
    return dict(hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters, impl=impl)


# jitted: every sublayer mixes alike, so a program traces and lowers the mix once a shape (24 traced calls, 40 layers)
@functools.partial(jax.jit, static_argnames=("hc_eps", "norm_eps", "sinkhorn_iters", "impl", "split_rows"))
def hc_mix(streams, fn, base, scale, *, hc_eps: float, norm_eps: float, sinkhorn_iters: int,
           impl: str = "xla", split_rows: bool = False):
    """The mix of one sublayer.

    streams [B,T,S,D]; fn f32 [(2+S)·S, S·D]; base f32 [(2+S)·S]; scale f32 [3].
    Returns pre f32 [B,T,S], post f32 [B,T,S], comb f32 [B,T,S,S] (comb[i, j]: source i → destination j).
    ``impl``: the comb's softmax + Sinkhorn (`pallas_kernels/hc_mix`): "pallas" (one kernel) or "xla".
    ``split_rows``: a row-parallel segment under a mesh: the comb op runs on each rank's rows
    (``sharding.kernels.hc_comb``).
    """
    s = streams.shape[-2]
    flat = streams.reshape(*streams.shape[:-2], -1)
    col_scale = jnp.concatenate([jnp.full((s,), scale[0]), jnp.full((s,), scale[1]), jnp.full((s * s,), scale[2])])
    # RMS(x̂)·fnᵀ as the official kernels round it (§B.3): the product of the raw streams, then the row's scale
    mix = f32_matmul(flat, fn) * rms_scale(flat, norm_eps) * col_scale + base
    pre = jax.nn.sigmoid(mix[..., :s]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(mix[..., s : 2 * s])
    comb = mix[..., 2 * s :].reshape(*mix.shape[:-1], s, s)
    op = hc_comb if split_rows else comb_op
    return pre, post, op(comb, iters=sinkhorn_iters, eps=hc_eps, impl=impl)


def collapse(streams: jnp.ndarray, weights: jnp.ndarray) -> jnp.ndarray:
    """Σ_i weights_i · streams_i: streams [B,T,S,D], weights f32 [B,T,S] -> [B,T,D] in the streams' dtype."""
    out = jnp.sum(weights[..., None] * streams.astype(jnp.float32), axis=-2)
    return out.astype(streams.dtype)


def expand(y: jnp.ndarray, streams: jnp.ndarray, post: jnp.ndarray, comb: jnp.ndarray) -> jnp.ndarray:
    """New streams_j = post_j · y + Σ_i comb[i, j] · streams_i; y [B,T,D] -> [B,T,S,D] in the streams' dtype."""
    mixed = jnp.sum(comb[..., None] * streams.astype(jnp.float32)[..., :, None, :], axis=-3)
    out = post[..., None] * y.astype(jnp.float32)[..., None, :] + mixed
    return out.astype(streams.dtype)
