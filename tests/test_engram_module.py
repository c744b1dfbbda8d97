"""The engram layer alone (`MODEL.md` §B.12 "Forward") against a float64 numpy transcription of the spec, and the
image-position rule (VISION.md §V.E.4: gate 0 ⇒ the streams pass through exactly)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import formats
from dsv41_jax.config import load_named
from dsv41_jax.model.engram import Engram, EngramInput


def _layer(cfg):
    layer = Engram(cfg, 1, dtype=jnp.float32, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    codes, scale = formats.fp8_rows_quantize(rng.standard_normal(layer.embed.weight.shape).astype(np.float32))
    layer.embed.weight.set_value(jnp.asarray(codes))
    layer.embed.scale.set_value(jnp.asarray(scale.view(np.uint8)))
    layer.q_weight.set_value(jnp.asarray(1 + 0.3 * rng.standard_normal(layer.q_weight.shape), jnp.float32))
    return layer, codes, scale


def _spec(x, rows, table, wkv, qw, kw, eps):
    """§B.12 in float64: x [T, S, D], rows [T, C]."""
    t, s, d = x.shape
    r = table[rows].reshape(t, -1)
    kv = r @ wkv.T
    key, val = kv[:, : s * d].reshape(t, s, d), kv[:, s * d:]

    def rinv(v):
        return (np.mean(v * v, axis=-1) + eps) ** -0.5

    dot = np.sum(x * qw * kw * key, axis=-1) * rinv(x) * rinv(key) / np.sqrt(d)
    gate = 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), 1e-6))))
    return x + gate[..., None] * val[:, None, :]


def test_forward_matches_the_spec_in_float64():
    cfg = load_named("tiny_engram")
    layer, codes, scale = _layer(cfg)
    rng = np.random.default_rng(1)
    t, cols = 12, 6
    x = rng.standard_normal((1, t, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    rows = rng.integers(0, cfg.engram_num_embeddings[0], (1, t, 1, cols))
    got = np.asarray(layer(jnp.asarray(x), EngramInput(jnp.asarray(rows, jnp.int32), jnp.ones((1, t), bool))))
    table = formats.fp8_rows_dequantize(codes, scale, dtype=np.float64)
    want = _spec(x[0].astype(np.float64), rows[0, :, 0], table, np.asarray(layer.wkv.weight[...], np.float64),
                 np.asarray(layer.q_weight[...], np.float64), np.asarray(layer.k_weight[...], np.float64),
                 cfg.rms_norm_eps)
    # f32 vs f64: a 192-term and a 64-term dot product, values O(1): a few f32 ulps
    np.testing.assert_allclose(got[0], want, rtol=0, atol=2e-5)
    assert np.abs(got[0] - x[0]).max() > 0.1  # the engram term is not small


def test_image_positions_pass_through_exactly():
    cfg = load_named("tiny_engram")
    layer, _, _ = _layer(cfg)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 5, cfg.hc_mult, cfg.hidden_size)), jnp.bfloat16)
    rows = jnp.asarray(rng.integers(0, 1000, (2, 5, 1, 6)), jnp.int32)
    text = jnp.asarray([[1, 0, 0, 1, 1], [0, 1, 1, 1, 0]], bool)
    out = np.asarray(layer(x, EngramInput(rows, text)).astype(jnp.float32))
    x = np.asarray(x.astype(jnp.float32))
    np.testing.assert_array_equal(out[~np.asarray(text)], x[~np.asarray(text)])
    assert (np.abs(out - x).max(axis=(-1, -2)) > 0)[np.asarray(text)].all()
