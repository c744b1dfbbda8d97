"""DSpark stages (`MODEL.md` §B.13, VISION.md §V.H): the stage attention against a dense numpy softmax over the
key set §V.H item 5 fixes (context rows at positions [max(0, P−W), P−1] plus all block rows, one sink), the taps
(the mean of the streams entering the target layers, computed here by running the blocks one by one), the
sequential Markov proposals, and the checkpoint round trip of `make_tiny --dspark`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import make_tiny, param_specs
from dsv41_jax.checkpoint import load_checkpoint
from dsv41_jax.config import load_named
from dsv41_jax.loading import build_model
from dsv41_jax.model.attention import CsaState, Segment
from dsv41_jax.model.cache import init_cache
from dsv41_jax.model.dspark import context_rows, draft
from dsv41_jax.model.hc import collapse
from dsv41_jax.model.rope import apply_rope
from dsv41_jax.model.transformer import ModelOptions, Transformer
from sharding import rules

ATOL = 1e-5  # f32 throughout (rounding points off): only summation order differs


def small_config():
    return load_named("tiny").replace(
        num_hidden_layers=3, compress_ratios=(0, 2, 0, 0, 0, 0), kv_source_layer_ids=(1,),
        index_source_layer_ids=(1,), candidate_source_layer_id=-1, dspark_target_layer_ids=(0, 1, 2))


@pytest.fixture(scope="module")
def model():
    cfg = small_config()
    return Transformer(cfg, ModelOptions(dtype="float32", quant_rounding=False, dspark=True), rngs=nnx.Rngs(3))


def _np_attention(stage, u, positions, ring, offset):
    """Dense numpy attention of block rows u [B,K,D] over the ring's rows at positions offset−W … offset−1 that
    are ≥ 0 plus every block row; q and the keys from the stage's own projections (RoPE applied)."""
    a = stage.attn
    b, k, _ = u.shape
    q = np.asarray(apply_rope(a.wq_b(a.q_norm(a.wq_a(u))).reshape(b, k, a.n_heads, a.head_dim),
                              positions[..., None], a.inv_freq), np.float64)
    block = np.asarray(stage.kv_rows(u, positions), np.float64)
    ring = np.asarray(ring, np.float64)
    w = ring.shape[1]
    sinks = np.asarray(a.attn_sink[...], np.float64)
    out = np.zeros((b, k, a.n_heads, a.head_dim))
    for bi in range(b):
        p = int(offset[bi])
        keys = [ring[bi, pos % w] for pos in range(max(0, p - w), p)] + list(block[bi])
        keys = np.stack(keys)  # [n, d]
        for t in range(k):
            for h in range(a.n_heads):
                s = keys @ q[bi, t, h] * a.head_dim**-0.5
                m = max(s.max(), sinks[h])
                e = np.exp(s - m)
                out[bi, t, h] = e @ keys / (e.sum() + np.exp(sinks[h] - m))
    o = apply_rope(jnp.asarray(out, jnp.float32), positions[..., None], a.inv_freq, inverse=True)
    return np.asarray(a._output(o))


def test_stage_attention_sees_ring_window_and_whole_block(model):
    cfg = model.cfg
    stage = model.mtp[1]
    rng = np.random.default_rng(0)
    b, k, w = 2, cfg.dspark_block_size, cfg.sliding_window
    offset = jnp.asarray([3, 21], jnp.int32)  # sequence 0: only positions 0..2 exist (slots ≥ 3 are garbage)
    positions = offset[:, None] + jnp.arange(k)[None, :]
    u = jnp.asarray(rng.normal(size=(b, k, cfg.hidden_size)), jnp.float32)
    ring = jnp.asarray(rng.normal(size=(b, w, cfg.head_dim)), jnp.float32)
    attend = nnx.jit(lambda stage, *args: stage._attend(*args))  # one program for the three calls
    got = np.asarray(attend(stage, u, positions, ring, offset))
    np.testing.assert_allclose(got, _np_attention(stage, u, positions, ring, offset), atol=ATOL)
    # Bidirectional inside the block: the last row changes the first row's output.
    u2 = u.at[:, -1].add(1.0)
    assert not np.allclose(np.asarray(attend(stage, u2, positions, ring, offset))[:, 0], got[:, 0], atol=1e-4)
    # Slots of positions < 0 are never seen.
    ring2 = ring.at[0, 3:].set(100.0)
    np.testing.assert_allclose(np.asarray(attend(stage, u, positions, ring2, offset))[0], got[0], atol=ATOL)


@nnx.jit
def _taps_by_hand(model, ids):
    """One program (op by op this is 45 s of eager dispatch on CPU): (logits with taps, logits without, the taps,
    the streams entering each layer [L] of [B,T,D] (the mean over the HC streams), computed by running the blocks
    one by one, the stages' context rows, and those rows by hand from the spec's formula)."""
    cfg = model.cfg
    cache = init_cache(cfg, ids.shape[0], 32, "float32")
    logits, _, _, taps = model.forward(ids, cache, taps=True)
    plain, _ = model(ids, cache)
    b, t = ids.shape
    s = cfg.hc_mult
    lengths = jnp.full((b,), t, jnp.int32)
    rows = jnp.arange(t)[None, :]
    seg = Segment(positions=jnp.broadcast_to(rows, (b, t)), valid=jnp.ones((b, t), bool),
                  offset=jnp.zeros((b,), jnp.int32), lengths=lengths)
    e = model.embed(ids)
    streams = jnp.broadcast_to(e[:, :, None, :], (b, t, s, e.shape[-1]))
    pre = jnp.broadcast_to(jax.nn.one_hot(0, s, dtype=jnp.float32), (b, t, s))
    csa = CsaState.empty(cfg.num_hidden_layers)
    entering = []
    for block, lc in zip(model.layers, cache.layers):
        entering.append(streams.mean(axis=2))
        streams, pre, _, csa = block(streams, pre, seg, lc, csa)
    # Context rows: m = RMS(τ·main_projᵀ; main_norm), then each stage's RMS(m·wkvᵀ; kv_norm) with RoPE.
    ctx = context_rows(model.mtp, taps.context, seg.positions)
    m = model.mtp[0].main_norm(model.mtp[0].main_proj(taps.context))
    want_ctx = [apply_rope(stage.attn.kv_norm(stage.attn.wkv(m)), seg.positions, stage.attn.inv_freq)
                for stage in model.mtp]
    return logits, plain, taps, entering, ctx, want_ctx


def test_taps_are_the_mean_of_streams_entering_target_layers(model):
    cfg = model.cfg
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 7)), jnp.int32)
    logits, plain, taps, entering, ctx, want_ctx = _taps_by_hand(model, ids)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(plain), atol=ATOL)  # taps change nothing
    want = np.concatenate([np.asarray(entering[i]) for i in cfg.dspark_target_layer_ids], axis=-1)
    np.testing.assert_allclose(np.asarray(taps.context), want, atol=ATOL)
    assert set(taps.pending) == {1}  # the ratio-2 compressor layer
    for c, w in zip(ctx, want_ctx, strict=True):
        np.testing.assert_allclose(np.asarray(c), np.asarray(w), atol=ATOL)


@nnx.jit
def _greedy_draft(model, bonus, offset):
    """A greedy draft from ``bonus`` [B] at ``offset`` [B] over empty rings, and its logits less the Markov bias of
    the token before each position (one program: op by op this is 17 s of eager dispatch on CPU)."""
    cfg = model.cfg
    b = bonus.shape[0]
    rings = tuple(jnp.zeros((b, cfg.sliding_window, cfg.head_dim), jnp.float32) for _ in model.mtp)
    greedy = lambda j, row: jnp.argmax(row, -1).astype(jnp.int32)
    d = draft(model.mtp, model.embed, model.head, bonus, rings, offset, cfg, cfg.dspark_block_size, greedy)
    before = [bonus, *[d.tokens[:, j] for j in range(cfg.dspark_block_size - 1)]]
    return d, d.logits - jnp.stack([model.mtp[-1].markov_head.bias(p) for p in before], 1)


def test_draft_markov_bias_is_sequential(model):
    cfg = model.cfg
    bonus = jnp.asarray([7, 100], jnp.int32)
    offset = jnp.asarray([0, 5], jnp.int32)
    d, streams_free = _greedy_draft(model, bonus, offset)
    last = model.mtp[-1]
    prev = np.asarray(bonus)
    for j in range(cfg.dspark_block_size):
        tok = np.asarray(d.tokens[:, j])
        assert (tok == np.asarray(jnp.argmax(d.logits[:, j], -1))).all()
        bias = np.asarray(last.markov_head.head.weight[...]) @ np.asarray(last.markov_head.embed.weight[...])[prev].T
        np.testing.assert_allclose(np.asarray(d.logits[:, j] - streams_free[:, j]), bias.T, atol=1e-4)
        prev = tok
    h = np.asarray(collapse(jnp.zeros((1, 1, cfg.hc_mult, cfg.hidden_size)), jnp.ones((1, 1, cfg.hc_mult))))
    assert h.shape == (1, 1, cfg.hidden_size) and d.confidence.shape == (len(bonus), cfg.dspark_block_size)


def test_make_tiny_dspark_round_trip(tmp_path):
    cfg = load_named("tiny")
    plain = make_tiny.random_weights(cfg, 0)
    weights = make_tiny.random_weights(cfg, 0, dspark=True)
    assert all(np.array_equal(plain[k], weights[k]) for k in plain)  # the stages are drawn after the target
    stage_names = set(weights) - set(plain)
    assert stage_names == set(param_specs.model_tensors(cfg, dspark=True)) - set(plain)
    assert weights["mtp.0.ffn.experts.w1.weight"].shape[0] == cfg.dspark_n_routed_experts
    assert weights["mtp.0.main_proj.weight"].shape == (cfg.hidden_size, 3 * cfg.hidden_size)
    stored = make_tiny.write_checkpoint(tmp_path, cfg, weights, "fp8")
    _, flat = load_checkpoint(tmp_path, dspark=True, progress=False)
    assert set(flat) == set(weights)
    for name in stage_names:
        np.testing.assert_array_equal(flat[name], stored[name])
    _, without = load_checkpoint(tmp_path, progress=False)
    assert set(without) == set(plain)
    m = build_model(cfg, ModelOptions(dtype="float32", dspark=True), flat)
    np.testing.assert_array_equal(np.asarray(m.mtp[2].markov_head.embed.weight[...]),
                                  flat["mtp.2.markov_head.embed.weight"])


@pytest.mark.parametrize("expert_format", ["dequantized", "fp4"])
@pytest.mark.parametrize("name", ["tiny", "dsv41_flash"])
def test_every_stage_tensor_matches_exactly_one_rule(name, expert_format):
    """The stages shard like a backbone layer (MODEL.md §F.1); the Markov head on the vocabulary axis."""
    cfg = load_named(name)
    stage_tensors = {k: v for k, v in param_specs.model_tensors(cfg, expert_format, dspark=True).items()
                     if k.startswith("mtp.")}
    assert f"mtp.{cfg.num_nextn_predict_layers - 1}.markov_head.head.weight" in stage_tensors
    for tensor, shape in stage_tensors.items():
        hits = rules.matching_rules(tensor)
        assert len(hits) == 1, (tensor, [h.pattern for h in hits])
        for layout in rules.LAYOUTS:
            assert len(rules.param_spec(tensor, len(shape), layout)) == len(shape)
    assert rules.param_spec("mtp.2.markov_head.embed.weight", 2, "tp")[0] is not None


def test_release_stage_inventory_counts_2401_tensors():
    """VISION.md §V.H item 15: the release holds 2401 ``mtp.*`` tensors (3 × 798 + 7), of which the three
    ``mtp.s.ffn.gate.bias_vl`` are image routing biases the stages never use (text bias only, item 8)."""
    cfg = load_named("dsv41_flash")
    names = [k for k in param_specs.expected_tensors(cfg, quantized=True, dspark=True) if k.startswith("mtp.")]
    assert len(names) + 3 == 2401
    assert param_specs.skip_reason("mtp.1.ffn.gate.bias_vl")
