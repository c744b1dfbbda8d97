"""The ViT (VISION.md §V.C) and the 3×3 aligner (§V.D) as Flax NNX modules.

State paths are the checkpoint names of §V.F under ``vision.`` / ``aligner.`` (the text model holds them as
its ``vision`` and ``aligner`` children). Batched over images with static shapes (`batch.ImageBatch`): padded
patches are masked out of the attention keys and never gathered by the aligner, so an image's output does not
depend on its bucket or on the other images of the batch.

Precision (§V.C.5): weights and activations in the model dtype; linear layers accumulate in f32 and add the
bias before rounding; RMSNorm and RoPE in f32; attention scores and softmax in f32. The weighted sum takes the
probabilities in the model dtype (f32 accumulation), as flash attention does: exact for a float32 model.
bf16 dots run at the default precision (bf16 inputs, f32 accumulation: the tensor cores); only a float32 model
asks for HIGHEST (IEEE f32 on a GPU, whose default would be TF32).

The 32 blocks run as one ``lax.scan`` over their weights stacked at call time (one block compiled, not 32).
Sharded (`sharding/rules.py`), the fused ``attn.wqkv`` / ``mlp.w1`` rows are grouped rank by rank
(``VisionConfig.shard_groups``): a group is read as ``[G, 3, heads, d]`` / ``[G, 2, columns]``, so each rank
computes q, k, v of its own heads and gate, up of its own columns; G = 1 is the checkpoint's order.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sharding.context import constrain

from ..config import ModelConfig, VisionConfig
from ..model.norms import HIGHEST, RMSNorm, random_normal
from ..planner import VISION_QUERY_CHUNK as QUERY_CHUNK  # XLA attention's query chunk (sized by the planner)
from .batch import ImageBatch


def _precision(dtype):
    """HIGHEST for a float32 model (no TF32 on a GPU); the default (bf16 tensor cores) otherwise."""
    return HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _constrain(x, activation: str):
    return constrain(x, activation)


class VisionLinear(nnx.Module):
    """``weight [out, in]`` (+ ``bias [out]``): y = x·Wᵀ + b, f32 accumulation, rounded once to x's dtype."""

    def __init__(self, din: int, dout: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(random_normal(rngs, (dout, din), din**-0.5, dtype))
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else None

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        y = jnp.einsum("...i,oi->...o", x, self.weight[...].astype(x.dtype), precision=_precision(x.dtype),
                       preferred_element_type=jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


def rope_tables(rows: jnp.ndarray, cols: jnp.ndarray, d: int, theta: float) -> tuple[jnp.ndarray, jnp.ndarray]:
    """2-D RoPE angles (§V.C.2) as (cos, sin) f32 [B, N, 1, d/2]; rows, cols [B, N] int32.

    Pair j < d/4 turns by row·f_j, pair d/4 + j by col·f_j, f_j = θ^(−j/(d/4))."""
    inv_freq = jnp.asarray(1.0 / (np.float32(theta) ** (np.arange(0, d // 2, 2, dtype=np.float32) / (d // 2))),
                           jnp.float32)
    angles = jnp.concatenate([rows[..., None].astype(jnp.float32) * inv_freq,
                              cols[..., None].astype(jnp.float32) * inv_freq], axis=-1)[:, :, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def rope_2d(u: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate-half pairing: pair j is (u[j], u[j + d/2]). u [B, N, H, d]; cos, sin [B, N, 1, d/2]."""
    a, b = jnp.split(u.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(u.dtype)


_FORCED_ATTENTION: contextvars.ContextVar[str | None] = contextvars.ContextVar("forced_attention", default=None)


def attention_impl(dtype) -> str:
    """cuDNN's fused (flash) attention for bf16 on a GPU; XLA's otherwise (f32, CPU); or what
    `forced_attention` names while its block traces."""
    forced = _FORCED_ATTENTION.get()
    if forced is not None:
        return forced
    return "cudnn" if jax.default_backend() == "gpu" and jnp.dtype(dtype) == jnp.bfloat16 else "xla"


@contextlib.contextmanager
def forced_attention(impl: str):
    """Trace the tower's attention with ``impl`` ("xla" | "cudnn") inside the block (a benchmark's choice)."""
    if impl not in ("xla", "cudnn"):
        raise ValueError(f"attention implementation {impl!r}: wanted xla or cudnn")
    token = _FORCED_ATTENTION.set(impl)
    try:
        yield
    finally:
        _FORCED_ATTENTION.reset(token)


def masked_attention(q, k, v, lengths, scale: float) -> jnp.ndarray:
    """Full attention of every query over the first ``lengths[b]`` keys of its image (the real patches come
    first, `batch.build_batch`). q, k, v [B, N, H, d]; lengths int32 [B] → [B, N, H, d].

    ``jax.nn.dot_product_attention``: cuDNN's fused kernel on a GPU in bf16 (no [N, N] scores in memory); XLA's
    in f32 or on CPU (or where cuDNN refuses the call while tracing), in chunks of ``QUERY_CHUNK`` queries
    (bounded scratch)."""
    impl = attention_impl(q.dtype)

    def block(qc):  # [B, c, H, d] -> [B, c, H, d]
        return jax.nn.dot_product_attention(qc, k, v, scale=scale, key_value_seq_lengths=lengths,
                                            implementation=impl)

    b, n, h, d = q.shape
    if impl == "cudnn":
        try:
            return block(q)
        except (RuntimeError, ValueError, NotImplementedError):  # cuDNN refused at trace time (version, GPU)
            impl = "xla"
    if n <= QUERY_CHUNK or n % QUERY_CHUNK:
        return block(q)
    chunks = q.reshape(b, n // QUERY_CHUNK, QUERY_CHUNK, h, d).swapaxes(0, 1)
    return jax.lax.map(block, chunks).swapaxes(0, 1).reshape(b, n, h, d)


class VisionAttention(nnx.Module):
    """``attn.wqkv`` [3·H·d, C] (+bias; q, k, v blocks, head-major; sharded: per rank group, see the module
    docstring) and ``attn.wo`` [C, H·d] (+bias)."""

    def __init__(self, vc: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.groups, self.heads, self.d = vc.shard_groups, vc.heads_per_group, vc.head_dim
        width = self.groups * self.heads * self.d
        self.wqkv = VisionLinear(vc.hidden_size, 3 * width, bias=True, dtype=dtype, rngs=rngs)
        self.wo = VisionLinear(width, vc.hidden_size, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, lengths):
        """x [B, N, C] -> [B, N, C]."""
        b, n, _ = x.shape
        qkv = self.wqkv(x).reshape(b, n, self.groups, 3, self.heads, self.d)
        q, k, v = (_constrain(qkv[:, :, :, i].reshape(b, n, -1, self.d), "vision_heads") for i in range(3))
        q, k = rope_2d(q, cos, sin), rope_2d(k, cos, sin)
        with jax.default_matmul_precision("highest" if x.dtype == jnp.float32 else "default"):
            o = masked_attention(q, k, v, lengths, self.d**-0.5)
        return self.wo(o.reshape(b, n, -1))


class VisionMLP(nnx.Module):
    """``mlp.w1`` [2I, C] (gate rows, then up rows; sharded: per rank group), ``mlp.w2`` [C, I]; no biases;
    SiLU, no clamp."""

    def __init__(self, vc: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.groups, self.width = vc.shard_groups, vc.mlp_per_group
        self.w1 = VisionLinear(vc.hidden_size, 2 * self.groups * self.width, bias=False, dtype=dtype, rngs=rngs)
        self.w2 = VisionLinear(self.groups * self.width, vc.hidden_size, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        h = self.w1(x).reshape(*x.shape[:-1], self.groups, 2, self.width)
        hidden = (jax.nn.silu(h[..., 0, :]) * h[..., 1, :]).reshape(*x.shape[:-1], -1)
        return self.w2(_constrain(hidden, "vision_mlp_hidden"))


class VisionBlock(nnx.Module):
    """``vision.blocks.ℓ``: pre-norm attention and MLP, two residuals (§V.C.3)."""

    def __init__(self, vc: VisionConfig, *, dtype, rngs: nnx.Rngs):
        self.norm1 = RMSNorm(vc.hidden_size, vc.norm_eps, dtype=dtype)
        self.attn = VisionAttention(vc, dtype=dtype, rngs=rngs)
        self.norm2 = RMSNorm(vc.hidden_size, vc.norm_eps, dtype=dtype)
        self.mlp = VisionMLP(vc, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
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
        self.dtype, self.head_dim, self.theta = dtype, vc.head_dim, vc.rope_theta
        self.patch_embed = PatchEmbed(vc, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([VisionBlock(vc, dtype=dtype, rngs=rngs) for _ in range(vc.num_hidden_layers)])
        self.norm = RMSNorm(vc.hidden_size, vc.norm_eps, dtype=dtype)

    def __call__(self, batch: ImageBatch) -> jnp.ndarray:
        lengths = jnp.sum(jnp.asarray(batch.valid), axis=-1, dtype=jnp.int32)
        cos, sin = rope_tables(jnp.asarray(batch.rows), jnp.asarray(batch.cols), self.head_dim, self.theta)
        x = self.patch_embed(jnp.asarray(batch.patches).astype(self.dtype))
        graphdef, _ = nnx.split(self.blocks[0])
        stacked = jax.tree.map(lambda *w: jnp.stack(w), *(nnx.state(b) for b in self.blocks))

        def step(x, weights):
            return nnx.merge(graphdef, weights)(x, cos, sin, lengths), None

        with jax.named_scope("vision_blocks"):
            x, _ = jax.lax.scan(step, x, stacked)
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
        return self.w2(_constrain(jax.nn.gelu(self.w1(z), approximate=False), "aligner_hidden"))
