"""The ViT (VISION.md §V.C) and the 3×3 aligner (§V.D) as Flax NNX modules.

State paths are the checkpoint names of §V.F under ``vision.`` / ``aligner.`` (the text model holds them as
its ``vision`` and ``aligner`` children). Batched over images with static shapes (`batch.ImageBatch`): padded
patches are masked out of the attention keys and never gathered by the aligner, so an image's output does not
depend on its bucket or on the other images of the batch.

Precision (§V.C.5): weights and activations in the model dtype; linear layers accumulate in f32 and add the
bias before rounding; RMSNorm and RoPE in f32; attention scores, softmax and the weighted sum in f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..config import ModelConfig, VisionConfig
from ..model.norms import HIGHEST, RMSNorm, random_normal
from .batch import ImageBatch

QUERY_CHUNK = 1024  # attention over at most this many queries at once: [B, H, 1024, N] f32 scores (§V.G)


class VisionLinear(nnx.Module):
    """``weight [out, in]`` (+ ``bias [out]``): y = x·Wᵀ + b, f32 accumulation, rounded once to x's dtype."""

    def __init__(self, din: int, dout: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(random_normal(rngs, (dout, din), din**-0.5, dtype))
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else None

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        y = jnp.einsum("...i,oi->...o", x, self.weight[...].astype(x.dtype), precision=HIGHEST,
                       preferred_element_type=jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


def rope_2d(u: jnp.ndarray, rows: jnp.ndarray, cols: jnp.ndarray, theta: float) -> jnp.ndarray:
    """2-D RoPE, rotate-half pairing (§V.C.2). u [B, N, H, d]; rows, cols [B, N] int32.

    Pair j < d/4 turns by row·f_j, pair d/4 + j by col·f_j, f_j = θ^(−j/(d/4)); pair j is (u[j], u[j + d/2]).
    """
    d = u.shape[-1]
    inv_freq = jnp.asarray(1.0 / (np.float32(theta) ** (np.arange(0, d // 2, 2, dtype=np.float32) / (d // 2))),
                           jnp.float32)
    angles = jnp.concatenate([rows[..., None].astype(jnp.float32) * inv_freq,
                              cols[..., None].astype(jnp.float32) * inv_freq], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    a, b = jnp.split(u.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(u.dtype)


def masked_attention(q, k, v, key_valid, scale: float) -> jnp.ndarray:
    """Full attention of every query over the valid keys of its image. q, k, v [B, N, H, d]; key_valid [B, N].
    Scores, softmax and the weighted sum in f32; queries in chunks of ``QUERY_CHUNK`` (bounded scratch)."""
    bias = jnp.where(key_valid, 0.0, -1e30)[:, None, None, :]  # [B, 1, 1, N]; finite: no NaN on padding

    def block(qc):  # [B, c, H, d] -> [B, c, H, d]
        s = jnp.einsum("bqhd,bkhd->bhqk", qc, k, precision=HIGHEST, preferred_element_type=jnp.float32)
        p = jax.nn.softmax(s * scale + bias, axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32), precision=HIGHEST)
        return o.astype(v.dtype)

    b, n, h, d = q.shape
    if n <= QUERY_CHUNK or n % QUERY_CHUNK:
        return block(q)
    chunks = q.reshape(b, n // QUERY_CHUNK, QUERY_CHUNK, h, d).swapaxes(0, 1)
    return jax.lax.map(block, chunks).swapaxes(0, 1).reshape(b, n, h, d)


class VisionAttention(nnx.Module):
    """``attn.wqkv`` [3C, C] (+bias; q, k, v blocks, head-major) and ``attn.wo`` [C, C] (+bias)."""

    def __init__(self, vc: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.heads, self.theta = vc.num_attention_heads, vc.rope_theta
        self.wqkv = VisionLinear(vc.hidden_size, 3 * vc.hidden_size, bias=True, dtype=dtype, rngs=rngs)
        self.wo = VisionLinear(vc.hidden_size, vc.hidden_size, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x, rows, cols, valid):
        """x [B, N, C] -> [B, N, C]."""
        b, n, c = x.shape
        q, k, v = (t.reshape(b, n, self.heads, c // self.heads) for t in jnp.split(self.wqkv(x), 3, axis=-1))
        q, k = rope_2d(q, rows, cols, self.theta), rope_2d(k, rows, cols, self.theta)
        o = masked_attention(q, k, v, valid, (c // self.heads) ** -0.5)
        return self.wo(o.reshape(b, n, c))


class VisionMLP(nnx.Module):
    """``mlp.w1`` [2I, C] (gate rows, then up rows; no bias), ``mlp.w2`` [C, I] (no bias); SiLU, no clamp."""

    def __init__(self, vc: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.w1 = VisionLinear(vc.hidden_size, 2 * vc.intermediate_size, bias=False, dtype=dtype, rngs=rngs)
        self.w2 = VisionLinear(vc.intermediate_size, vc.hidden_size, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        gate, up = jnp.split(self.w1(x), 2, axis=-1)
        return self.w2(jax.nn.silu(gate) * up)


class VisionBlock(nnx.Module):
    """``vision.blocks.ℓ``: pre-norm attention and MLP, two residuals (§V.C.3)."""

    def __init__(self, vc: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.norm1 = RMSNorm(vc.hidden_size, vc.norm_eps, dtype=dtype)
        self.attn = VisionAttention(vc, dtype=dtype, rngs=rngs)
        self.norm2 = RMSNorm(vc.hidden_size, vc.norm_eps, dtype=dtype)
        self.mlp = VisionMLP(vc, dtype=dtype, rngs=rngs)

    def __call__(self, x, rows, cols, valid):
        x = x + self.attn(self.norm1(x), rows, cols, valid)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nnx.Module):
    """``vision.patch_embed.proj`` [C, 3·ps²] + bias: a linear layer on the flattened patch (§V.C.1)."""

    def __init__(self, vc: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.proj = VisionLinear(vc.patch_dim, vc.hidden_size, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, patches):
        return self.proj(patches)


class VisionTower(nnx.Module):
    """``vision.*``: patch embedding, N_v blocks, final norm. ``F = tower(batch)`` [B, N, C] (padded rows:
    don't-care)."""

    def __init__(self, vc: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        self.patch_embed = PatchEmbed(vc, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([VisionBlock(vc, dtype=dtype, rngs=rngs) for _ in range(vc.num_hidden_layers)])
        self.norm = RMSNorm(vc.hidden_size, vc.norm_eps, dtype=dtype)

    def __call__(self, batch: ImageBatch) -> jnp.ndarray:
        rows, cols, valid = jnp.asarray(batch.rows), jnp.asarray(batch.cols), jnp.asarray(batch.valid)
        x = self.patch_embed(jnp.asarray(batch.patches).astype(self.dtype))
        for i, block in enumerate(self.blocks):
            with jax.named_scope(f"vision_block_{i}"):
                x = block(x, rows, cols, valid)
        return self.norm(x)


class Aligner(nnx.Module):
    """``aligner.w1`` [D, r²·C] (+bias), ``aligner.w2`` [D, D] (+bias): 3×3 space-to-depth, then
    gelu(z·A1ᵀ + a1)·A2ᵀ + a2 with the exact (erf) GELU (§V.D)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        vc = cfg.vision
        self.w1 = VisionLinear(vc.downsample_ratio**2 * vc.hidden_size, cfg.hidden_size, bias=True, dtype=dtype,
                               rngs=rngs)
        self.w2 = VisionLinear(cfg.hidden_size, cfg.hidden_size, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, features: jnp.ndarray, batch: ImageBatch) -> jnp.ndarray:
        """features [B, N, C] → E [B, M, D] (rows ≥ an image's m: don't-care)."""
        gather, ok = jnp.asarray(batch.gather), jnp.asarray(batch.gather_valid)
        b, m, r2 = gather.shape
        cells = jnp.take_along_axis(features, gather.reshape(b, m * r2, 1), axis=1).reshape(b, m, r2, -1)
        cells = jnp.where(ok[..., None], cells, 0)  # partial cells: exact zeros (§V.D)
        z = cells.swapaxes(-1, -2).reshape(b, m, -1)  # element c·r² + 3·di + dj
        return self.w2(jax.nn.gelu(self.w1(z), approximate=False))
