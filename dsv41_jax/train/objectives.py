"""The trainable model and the three objectives.

`trainable_model(cfg, seed)` is the project's `Transformer` (XLA ops, float32, DSpark stages built) with two
training-time substitutions, both invisible to the exported checkpoint:

* each engram layer's table is a float32 parameter (`FloatTable`), seen through its fp8-rows value; the model's
  own table holds e4m3 codes, which have no gradient;
* each router (`CountingRouter`) also reports how many tokens chose each expert, for the routing-bias update.

Objectives (each a function of a merged model, under ``jax.grad``):

* `lm_loss`: next-token cross-entropy of the target;
* `indexer_loss`: the lightning indexer of each index-source layer distilled against the main attention: KL from
  the heads' mean attention distribution over the compressed entries to the softmax of the indexer's scores,
  with the main model's activations held fixed (only the indexer learns from it: the top-k it feeds has no
  gradient, as in DeepSeek's sparse attention);
* `dspark_loss`: the draft stages on the frozen target's taps: each anchor P takes the stage rings of the context
  rows of positions < P, drafts the block ``[x_P, noise ×(K−1)]`` with teacher-forced Markov inputs, and each row
  j is fitted to the target's own distribution for position P+1+j; the confidence head learns whether row j's
  argmax is the target's.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..config import ModelConfig
from ..model.cache import init_cache
from ..model.dspark import context_rows
from ..model.engram import EngramInput
from ..model.hc import collapse
from ..model.moe import Router
from ..model.norms import HIGHEST
from ..model.rope import apply_rope
from ..model.transformer import ModelOptions, Transformer

OPTIONS = ModelOptions(dtype="float32", quant_rounding=False, attention_impl="xla", moe_impl="xla",
                       indexer_impl="xla", hc_impl="xla", dspark=True, scan_layers=False)

_LOADS: list | None = None  # set while a forward records expert loads (`recording_loads`)


class FloatTable(nnx.Module):
    """An engram table [rows, d] in float32 (`quantize.as_stored` gives the forward its fp8-rows value)."""

    def __init__(self, rows: int, dim: int, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (rows, dim), jnp.float32) * 0.5)

    def __call__(self, idx, dtype):
        return jnp.take(self.weight[...], idx, axis=0).astype(dtype)


class CountingRouter(Router):
    """A `Router` that adds its per-expert token counts to the recording list (`recording_loads`)."""

    def __call__(self, x, is_image=None):
        ids, w = super().__call__(x, is_image)
        if _LOADS is not None:
            _LOADS.append((self.owner, jnp.zeros(self.bias.shape, jnp.float32).at[ids.reshape(-1)].add(1.0)))
        return ids, w


@contextlib.contextmanager
def recording_loads():
    """Collects ``(router owner, counts [E])`` of every routed forward inside the block (under one trace)."""
    global _LOADS
    _LOADS = []
    try:
        yield _LOADS
    finally:
        _LOADS = None


def trainable_model(cfg: ModelConfig, seed: int) -> Transformer:
    model = Transformer(cfg, OPTIONS, rngs=nnx.Rngs(seed))
    rngs = nnx.Rngs(seed + 1)
    for path, module in list(model.iter_modules()):
        name = ".".join(map(str, path))
        if isinstance(module, Router):
            module.__class__ = CountingRouter
            module.owner = name
        if name.endswith(".engram"):
            module.embed = FloatTable(*module.embed.weight.shape, rngs)
    return model


def _xent(logits, labels):
    """Mean cross-entropy of f32 logits [..., V] against int labels [...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def target_forward(model: Transformer, ids, engram_rows):
    """(logits [B,T,V] f32, taps) of the target over whole sequences ids [B,T] from position 0."""
    b, t = ids.shape
    cache = init_cache(model.cfg, b, t, "float32")
    rows = EngramInput(rows=engram_rows, text=jnp.ones((b, t), bool)) if model.engram_layers else None
    logits, _, _, taps = model.forward(ids, cache, engram=rows, taps=True)
    return logits, taps


def lm_loss(logits, ids):
    return _xent(logits[:, :-1], ids[:, 1:])


def indexer_loss(model: Transformer, taps) -> jnp.ndarray:
    """Mean over index-source layers of KL(main attention over entries ‖ indexer), main activations fixed."""
    cfg = model.cfg
    losses = []
    for layer in cfg.index_source_layer_ids:
        if cfg.role(layer) != "full" or layer not in taps.pending:
            continue  # a reindex layer has no compressor of its own: its keys are another layer's
        losses.append(_indexer_kl(model.layers[layer].attn, jax.lax.stop_gradient(taps.pending[layer])))
    return sum(losses) / max(1, len(losses))


def _indexer_kl(attn, u):
    b, t, _ = u.shape
    r = attn.ratio
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    zeros = jnp.zeros((b,), jnp.int32)
    q_res = jax.lax.stop_gradient(attn.q_norm(attn.wq_a(u)))
    q = attn.wq_b(q_res).reshape(b, t, attn.n_heads, attn.head_dim)
    q = jax.lax.stop_gradient(apply_rope(q, positions[..., None], attn.inv_freq))
    pend = None if r == 1 else jnp.zeros((b, r - 1, attn.head_dim), jnp.float32)
    latent, entry, _, _, _ = attn.compressor(u, zeros, jnp.full((b,), t, jnp.int32), pend, pend)
    latent = jax.lax.stop_gradient(latent)
    pos = entry * r
    kvc = apply_rope(latent, pos, attn.inv_freq)
    visible = jnp.arange(latent.shape[1])[None, None, :] < ((positions + 1) // r)[..., None]  # [B,T,N]
    s = jnp.einsum("bthd,bnd->bthn", q, kvc, precision=HIGHEST) * attn.head_dim**-0.5
    s = jnp.where(visible[:, :, None, :], s, -jnp.inf)
    p_main = jnp.mean(jax.nn.softmax(s, axis=-1), axis=2)  # [B,T,N]; rows with no entry: nan, masked below
    ix = attn.indexer
    qi = ix.wq_b(q_res).reshape(b, t, ix.n_heads, ix.head_dim)
    qi = apply_rope(qi, positions[..., None], attn.inv_freq)
    ki = ix.index_keys(latent, pos, attn.inv_freq, False)
    w = ix.weights_proj(u).astype(jnp.float32) * ix.n_heads**-0.5
    score = jnp.einsum("bthd,bnd->bthn", qi, ki, precision=HIGHEST)
    score = jnp.sum(jnp.maximum(score, 0.0) * ix.head_dim**-0.5 * w[..., None], axis=2)
    logq = jax.nn.log_softmax(jnp.where(visible, score, -1e30), axis=-1)
    has = visible[..., 0]  # at least one visible entry
    p = jnp.where(visible & has[..., None], jax.lax.stop_gradient(p_main), 0.0)
    kl = jnp.sum(jnp.where(p > 0, p * (jnp.log(jnp.maximum(p, 1e-30)) - logq), 0.0), axis=-1)
    return jnp.sum(kl) / jnp.maximum(jnp.sum(has), 1)


def anchor_rings(ctx, anchors, w: int):
    """ctx [B,T,d] context rows, anchors [B,A] → rings [B·A, W, d] as the speculator holds them at offset P
    (slot p mod W holds position p, for p in P−W … P−1; positions below 0 are zero rows, masked by the stage)."""
    slots = jnp.arange(w)[None, None, :]
    start = (anchors - w)[..., None]
    pos = start + (slots - start) % w  # [B,A,W]: the position slot s holds
    rows = jnp.take_along_axis(ctx[:, None], jnp.maximum(pos, 0)[..., None], axis=2)  # [B,A,W,d]
    rows = jnp.where((pos >= 0)[..., None], rows, 0.0)
    return rows.reshape(-1, w, ctx.shape[-1])


def dspark_loss(model: Transformer, ids, target_logits, taps, anchors):
    """(soft cross-entropy of the drafts, confidence BCE, greedy agreement of row 0) for anchors [B,A]."""
    cfg = model.cfg
    k, s, w = cfg.dspark_block_size, cfg.hc_mult, cfg.sliding_window
    b, t = ids.shape
    a = anchors.shape[1]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    ctx = context_rows(model.mtp, jax.lax.stop_gradient(taps.context), positions)
    rings = [anchor_rings(c.astype(jnp.float32), anchors, w) for c in ctx]
    offset = anchors.reshape(-1)
    rel = jnp.arange(k, dtype=jnp.int32)
    block_pos = offset[:, None] + rel[None, :]  # [B·A, K]
    bonus = jnp.take_along_axis(ids, anchors, axis=1).reshape(-1)
    block = jnp.concatenate([bonus[:, None], jnp.full((b * a, k - 1), cfg.dspark_noise_token_id, jnp.int32)], 1)
    e = model.embed(block)
    streams = jnp.broadcast_to(e[:, :, None, :], (b * a, k, s, e.shape[-1]))
    pre = jnp.broadcast_to(jax.nn.one_hot(0, s, dtype=jnp.float32), (b * a, k, s))
    for stage, ring in zip(model.mtp, rings, strict=True):
        streams, pre = stage(streams, pre, block_pos, ring, offset)
    last = model.mtp[-1]
    h = collapse(streams, pre)
    base = model.head(last.norm(h))  # [B·A, K, V]
    rows_ids = jnp.repeat(jnp.arange(b), a)[:, None]
    prev = ids[rows_ids, block_pos]  # teacher-forced Markov inputs x_{P+j}
    markov = last.markov_head.bias(prev.reshape(-1)).reshape(b * a, k, -1)
    logits = base + markov
    teacher = jax.nn.softmax(jax.lax.stop_gradient(target_logits[rows_ids, block_pos]), axis=-1)
    xent = -jnp.mean(jnp.sum(teacher * jax.nn.log_softmax(logits, axis=-1), axis=-1))
    agree = (jnp.argmax(logits, -1) == jnp.argmax(teacher, -1)).astype(jnp.float32)
    pe = jnp.take(last.markov_head.embed.weight[...], prev, axis=0)
    conf = last.confidence_head(jax.lax.stop_gradient(h), jax.lax.stop_gradient(pe))
    bce = jnp.mean(jnp.maximum(conf, 0) - conf * agree + jnp.log1p(jnp.exp(-jnp.abs(conf))))
    return xent, bce, jnp.mean(agree, axis=0)


def sample_anchors(rng: np.random.Generator, batch: int, count: int, length: int, k: int) -> np.ndarray:
    """int32 [batch, count] anchors P in 1 … length − k (row j's target is the logits at P + j ≤ length − 1)."""
    return rng.integers(1, length - k + 1, size=(batch, count)).astype(np.int32)
