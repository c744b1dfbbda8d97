"""DSpark draft stages (`mtp.0–2`, `MODEL.md` §B.13, VISION.md §V.H): a parallel five-position drafter.

Each stage is a window-only decoder layer (HC mixes, attention, 128-expert top-3 MoE with the text ``bias``) whose
attention keys are the stage's own context ring (positions ``[P−W, P−1]``, written from the target's taps) plus
the block's rows (bidirectional inside the block). ``mtp.0`` also owns the tap projection (``main_proj``,
``main_norm``); the last stage owns the output norm, the Markov head and the confidence head. ``embed`` and
``head`` are the target's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import ModelConfig
from .attention import Attention, window_in_order
from .hc import collapse, expand, hc_mix, mix_kwargs, mix_params
from .moe import MoE
from .norms import HIGHEST, RMSNorm, random_normal
from .quant import round_window_kv
from .rope import apply_rope


def stage_config(cfg: ModelConfig) -> ModelConfig:
    """The config a stage's MoE reads: ``dspark_n_routed_experts`` experts, top ``dspark_num_experts_per_tok``."""
    return cfg.replace(n_routed_experts=cfg.dspark_n_routed_experts,
                       num_experts_per_tok=cfg.dspark_num_experts_per_tok)


class MarkovHead(nnx.Module):
    """``markov_head.embed.weight`` [V, R], ``markov_head.head.weight`` [V, R]."""

    def __init__(self, vocab: int, rank: int, *, dtype, rngs: nnx.Rngs):
        self.embed = _Weight((vocab, rank), 1.0, dtype, rngs)
        self.head = _Weight((vocab, rank), rank**-0.5, dtype, rngs)

    def bias(self, prev: jnp.ndarray) -> jnp.ndarray:
        """prev [B] int32 -> f32 [B, V] = head · embed[prev] (an f32 product, §V.H item 10)."""
        e = jnp.take(self.embed.weight[...], prev, axis=0).astype(jnp.float32)
        return jnp.einsum("br,vr->bv", e, self.head.weight[...].astype(jnp.float32), precision=HIGHEST)


class _Weight(nnx.Module):
    def __init__(self, shape, std, dtype, rngs):
        self.weight = nnx.Param(random_normal(rngs, shape, std, dtype))


class ConfidenceHead(nnx.Module):
    """``confidence_head.proj.weight`` [1, D + R]: the raw f32 logit of ``[h_j ; markov embed[prev_j]]``."""

    def __init__(self, dim: int, *, dtype, rngs: nnx.Rngs):
        self.proj = _Weight((1, dim), dim**-0.5, dtype, rngs)

    def __call__(self, h: jnp.ndarray, e: jnp.ndarray) -> jnp.ndarray:
        x = jnp.concatenate([h.astype(jnp.float32), e.astype(jnp.float32)], axis=-1)
        return jnp.einsum("...i,i->...", x, self.proj.weight[...][0].astype(jnp.float32), precision=HIGHEST)


class Stage(nnx.Module):
    """``mtp.s``: one draft stage. ``__call__(streams [B,K,S,D], pre f32 [B,K,S], positions [B,K], ring [B,W,d],
    offset [B])`` -> (streams, pre of the FFN mix)."""

    def __init__(self, cfg: ModelConfig, stage: int, options, *, rngs: nnx.Rngs):
        dtype = options.jnp_dtype
        layer = cfg.num_hidden_layers + stage
        if cfg.ratio(layer) != 0:
            raise ValueError(f"DSpark stage {stage} (compress_ratios[{layer}]) must be window-only (ratio 0)")
        self.hc_kwargs = mix_kwargs(cfg, options.hc_impl)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = mix_params(cfg, rngs)  # the two HC mixes (§B.3)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = mix_params(cfg, rngs)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.attn = Attention(cfg, layer, dtype=dtype, rounding=options.quant_rounding, impl="reference", rngs=rngs,
                              dense=options.dense)
        self.ffn = MoE(stage_config(cfg), dtype=dtype, moe_impl=options.moe_impl, rngs=rngs,
                       expert_format=options.expert_format, dense=options.dense)  # text bias only (§V.H item 8)
        n_taps = len(cfg.dspark_target_layer_ids)
        if stage == 0:
            self.main_proj = options.dense.linear(n_taps * cfg.hidden_size, cfg.hidden_size, dtype=dtype,
                                                  rngs=rngs, rule="mtp.0.main_proj")
            self.main_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if stage == cfg.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, dtype=dtype, rngs=rngs)
            self.confidence_head = ConfidenceHead(cfg.hidden_size + cfg.dspark_markov_rank, dtype=dtype, rngs=rngs)

    def kv_rows(self, x: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
        """x [B,T,D] -> FP8_round(RoPE(RMS(x·wkvᵀ; kv_norm), p)) [B,T,d] (context rows and block rows, §B.13)."""
        a = self.attn
        kv = a.kv_norm(a.wkv(x))
        return round_window_kv(apply_rope(kv, positions, a.inv_freq), a.rounding)

    def __call__(self, streams, pre_prev, positions, ring, offset):
        with jax.named_scope("attn"):
            pre_a, post_a, comb_a = hc_mix(streams, self.hc_attn_fn[...], self.hc_attn_base[...],
                                           self.hc_attn_scale[...], **self.hc_kwargs)
            y = self._attend(self.attn_norm(collapse(streams, pre_prev)), positions, ring, offset)
            streams = expand(y, streams, post_a, comb_a)
        with jax.named_scope("moe"):
            pre_f, post_f, comb_f = hc_mix(streams, self.hc_ffn_fn[...], self.hc_ffn_base[...],
                                           self.hc_ffn_scale[...], **self.hc_kwargs)
            y = self.ffn(self.ffn_norm(collapse(streams, pre_a)))  # text bias only (§V.H item 8)
            return expand(y, streams, post_f, comb_f), pre_f

    def _attend(self, u, positions, ring, offset):
        """u [B,K,D]: every block row sees the ring's rows at positions [max(0, P−W), P−1] and all K block rows
        (§V.H item 5: one fixed key set); one f32 softmax with the sink; V = K."""
        a = self.attn
        b, k, _ = u.shape
        q = a.wq_b(a.q_norm(a.wq_a(u))).reshape(b, k, a.n_heads, a.head_dim)
        q = apply_rope(q, positions[..., None], a.inv_freq)
        w = ring.shape[1]
        ctx = window_in_order(ring, offset)  # positions offset−W … offset−1
        ctx_ok = (offset[:, None] - w + jnp.arange(w)[None, :]) >= 0  # [B,W]
        keys = jnp.concatenate([ctx.astype(jnp.float32), self.kv_rows(u, positions).astype(jnp.float32)], axis=1)
        ok = jnp.concatenate([ctx_ok, jnp.ones((b, k), bool)], axis=1)  # [B,W+K]
        s = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), keys, precision=HIGHEST) * a.head_dim**-0.5
        s = jnp.where(ok[:, None, None, :], s, -jnp.inf)
        sinks = a.attn_sink[...].astype(jnp.float32)
        m = jnp.maximum(jnp.max(s, axis=-1), sinks[None, None, :])
        p = jnp.exp(s - m[..., None])
        denom = jnp.sum(p, axis=-1) + jnp.exp(sinks[None, None, :] - m)
        o = (jnp.einsum("bths,bsd->bthd", p, keys, precision=HIGHEST) / denom[..., None]).astype(u.dtype)
        o = apply_rope(o, positions[..., None], a.inv_freq, inverse=True)
        return a._output(o)


class Draft(NamedTuple):
    """One draft round: ``tokens`` int32 [B,K] (row j proposes position P+1+j), ``logits`` f32 [B,K,V] (base +
    Markov bias: the distribution each token was drawn from, before temperature/top-k/top-p), ``confidence``
    f32 [B,K] (raw logits)."""

    tokens: jnp.ndarray
    logits: jnp.ndarray
    confidence: jnp.ndarray


def main_x(stage0: Stage, taps: jnp.ndarray) -> jnp.ndarray:
    """taps [B,T,n·D] (τ_t, model dtype) -> m_t = RMS(τ_t·main_projᵀ; main_norm) [B,T,D] (§B.13)."""
    return stage0.main_norm(stage0.main_proj(taps))


def context_rows(stages, taps: jnp.ndarray, positions: jnp.ndarray) -> tuple[jnp.ndarray, ...]:
    """taps [B,T,n·D], positions [B,T] -> each stage's context rows c^s_t [B,T,d] (§B.13)."""
    m = main_x(stages[0], taps)
    return tuple(stage.kv_rows(m, positions) for stage in stages)


def draft(stages, embed, head, bonus, rings, offset, cfg: ModelConfig, k: int, pick, vocab=None) -> Draft:
    """One draft round (§B.13): ids ``[b, noise ×(K−1)]`` at positions ``offset … offset+K−1`` through every
    stage, then the sequential Markov-corrected proposals.

    bonus [B] int32 (the token at ``offset``, not yet in the rings); rings: per stage [B,W,d] holding context rows
    of positions < offset; ``k`` = the block size (5). ``pick(j, logits [B,V]) -> tokens [B]`` draws row j's
    token (argmax, or a sample after temperature/top-k/top-p). ``vocab``: a sharded model's (padded ids, real
    logits) maps (`sharding.layout.ShardPlan`); None: the identity. Returns the first ``k`` rows' draft."""
    pad_ids, real = vocab or ((lambda x: x), (lambda x: x))
    b = bonus.shape[0]
    s = cfg.hc_mult
    ids = jnp.concatenate([bonus[:, None], jnp.full((b, k - 1), cfg.dspark_noise_token_id, jnp.int32)], axis=1)
    positions = offset[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    e = embed(pad_ids(ids))
    streams = jnp.broadcast_to(e[:, :, None, :], (b, k, s, e.shape[-1]))
    pre = jnp.broadcast_to(jax.nn.one_hot(0, s, dtype=jnp.float32), (b, k, s))
    for i, (stage, ring) in enumerate(zip(stages, rings, strict=True)):
        with jax.named_scope(f"dspark_{i}"):
            streams, pre = stage(streams, pre, positions, ring, offset)
    last = stages[-1]
    h = collapse(streams, pre)  # [B,K,D] pre-norm
    base = real(head(last.norm(h)).astype(jnp.float32))  # [B,K,V]
    prev = bonus
    tokens, logits, conf = [], [], []
    for j in range(k):  # sequential: row j's bias depends on row j−1's token
        row = base[:, j] + real(last.markov_head.bias(pad_ids(prev)))
        conf.append(last.confidence_head(h[:, j], jnp.take(last.markov_head.embed.weight[...], pad_ids(prev),
                                                           axis=0)))
        prev = pick(j, row)
        tokens.append(prev)
        logits.append(row)
    return Draft(jnp.stack(tokens, 1), jnp.stack(logits, 1), jnp.stack(conf, 1))
