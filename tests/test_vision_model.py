"""The image path end to end against mlx-vlm 0.7.10's independent ``deepseek_v41`` (``mlx_vlm_vision_oracle``)
on a random tiny checkpoint in the official naming (``configs/tiny_vision.json``, VISION.md §V.A TINY-V),
float32 on both sides, rounding points off (mlx-vlm's many more QAT roundings make only that comparable).

Tolerances: tower + aligner 1e-5 absolute on outputs of size ~2 (both compute the same f32 math; observed ≤ 1.1e-6,
summation order only). Our bf16 policy (§V.C.5) against mlx-vlm's f32: every row's cosine ≥ 0.9995 and at most
0.05 absolute (a few bf16 ulps at |E| ≈ 2; observed cosine 0.99998, 0.0125), as fastllm bounds its bf16 tower.
Prefill logits 1e-4 absolute (logits O(4); as the text parity test: f32 last-bit differences through 10 layers,
observed ≤ 1e-5).

The checkpoint's ``bias_vl`` is boosted by +10 for experts 0 and 1 in every layer, so image rows must pick those
two (as fastllm's test does): a model that routed image rows with ``bias`` would differ from mlx-vlm by O(1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from mlx_vlm_vision_oracle import HAVE_MLX_VLM

if not HAVE_MLX_VLM:
    pytest.skip("mlx-vlm (test extra) is not installed", allow_module_level=True)
from mlx_vlm_vision_oracle import fake_quant_off, load_vlm, vlm_encode, vlm_prefill

from dsv41_jax.checkpoint import load_checkpoint
from dsv41_jax.config import load_named
from dsv41_jax.engine import Engine, Request
from dsv41_jax.loading import build_model
from dsv41_jax.make_tiny import random_weights, write_checkpoint
from dsv41_jax.model.transformer import ModelOptions
from dsv41_jax.vision.batch import build_batch
from dsv41_jax.vision.preprocess import expand_prompt, load_image, prepare_image

FIXTURE = Path(__file__).parent / "fixtures" / "test_image.png"
CFG = load_named("tiny_vision")
F32 = ModelOptions(dtype="float32", quant_rounding=False, vision=True)
MAX_CONTEXT = 64


def _image(w, h, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(our f32 model, mlx-vlm model, an engine over our model, our bf16 model)."""
    path = tmp_path_factory.mktemp("tiny_vision")
    weights = random_weights(CFG, seed=3)
    for layer in range(CFG.num_hidden_layers):
        weights[f"layers.{layer}.ffn.gate.bias_vl"][:2] += 10.0
    write_checkpoint(path, CFG, weights, "none")
    _, flat = load_checkpoint(path, vision=True, progress=False)
    model = build_model(CFG, F32, flat)
    engine = Engine(model, CFG, max_context=MAX_CONTEXT, cache_dtype="float32", short_rows=0)
    return model, load_vlm(path), engine, build_model(CFG, ModelOptions(vision=True), flat)


def test_tower_and_aligner_match_mlx_vlm(setup):
    model, vlm, _, bf16_model = setup
    images = [prepare_image(_image(w, h, i), CFG.vision)
              for i, (w, h) in enumerate([(20, 40), (40, 20), (56, 56), (100, 70), (30, 300)])]
    images.append(load_image(FIXTURE, CFG.vision))
    batch = build_batch(images, CFG.vision)
    encode = nnx.jit(lambda m, b: m.encode_images(b))
    encoded = np.asarray(encode(model, batch))
    for i, im in enumerate(images):
        ref = vlm_encode(vlm, im.patches, im.plan.Hv, im.plan.Wv)
        np.testing.assert_allclose(encoded[i, : im.plan.n_tokens], ref, atol=1e-5, rtol=0)
    bf16 = np.asarray(encode(bf16_model, batch)).astype(np.float32)
    for i, im in enumerate(images):
        ref, got = vlm_encode(vlm, im.patches, im.plan.Hv, im.plan.Wv), bf16[i, : im.plan.n_tokens]
        cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
        assert cos.min() >= 0.9995 and np.abs(got - ref).max() <= 0.05, (i, cos.min(), np.abs(got - ref).max())
    # An image's rows do not depend on its bucket or its batch neighbours (padding is masked out).
    alone = build_batch(images[4:5], CFG.vision, n_bucket=2 * batch.patches.shape[1])
    again = np.asarray(encode(model, alone))
    np.testing.assert_allclose(again[0, : images[4].plan.n_tokens], encoded[4, : images[4].plan.n_tokens],
                               atol=1e-6, rtol=0)


def _prompt():
    """Text, image (100×70: span 10), text, image (30×300: span 18), text: 43 positions."""
    images = [load_image(FIXTURE, CFG.vision), prepare_image(_image(30, 300, 9), CFG.vision)]
    return expand_prompt(_PROMPT_IDS, images, CFG.image_token_id)


_PROMPT_IDS = (0, 17, 42, 99, 7, CFG.image_token_id, 5, 6, 300, 11, CFG.image_token_id, 12, 13, 14, 15, 16, 200)


def _mlx_logits(vlm, prompt, chunks=None, image_mask=True):
    records = [(s, im.patches, im.plan.Hv, im.plan.Wv, prompt.roles[s: s + im.plan.span_len])
               for s, im in zip(prompt.starts, prompt.images)]
    with fake_quant_off():
        return vlm_prefill(vlm, prompt.ids, records, chunks, image_mask=image_mask)


def _engine_logits(engine, prompt, chunks, new_tokens=1):
    engine.segment_plan = lambda n: chunks
    result = engine.generate([Request(prompt.ids, max_new_tokens=new_tokens, images=prompt)], record_logits=True)
    return result.prefill_logits, result.generations[0].token_ids, result.decode_logits


def test_merged_prefill_matches_mlx_vlm(setup):
    """Two images with text between and after, one prefill segment."""
    _, vlm, engine, _ = setup
    prompt = _prompt()
    assert len(prompt.ids) == 43 and prompt.starts == (5, 19)
    ref = _mlx_logits(vlm, prompt)
    ours, tokens, _ = _engine_logits(engine, prompt, [43])
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    assert tokens == (int(np.argmax(ref[-1])),)
    # mlx-vlm routing image rows with `bias` instead of `bias_vl` is far off: the comparison above sees bias_vl.
    assert np.abs(_mlx_logits(vlm, prompt, image_mask=False) - ref).max() > 0.1


def test_engine_segments_crossing_spans_match_mlx_vlm(setup):
    """The engine feeds each segment its slice of the image rows: segments [11, 11, 11, 10] cut the first span
    (positions 5…14) at 11 and the second (19…36) at 22 and 33; mlx-vlm runs the same chunks. Then two decode
    steps (text rows after the spans), against mlx-vlm fed the same tokens as two more one-row chunks."""
    _, vlm, engine, _ = setup
    prompt = _prompt()
    chunks = [11, 11, 11, 10]
    ours, tokens, decode = _engine_logits(engine, prompt, chunks, new_tokens=3)
    longer = expand_prompt(list(_PROMPT_IDS) + list(tokens[:2]), prompt.images, CFG.image_token_id)
    ref = _mlx_logits(vlm, longer, chunks + [1, 1])
    np.testing.assert_allclose(ours, ref[:43], atol=1e-4, rtol=0)
    np.testing.assert_allclose(decode, ref[42:], atol=1e-4, rtol=0)
    np.testing.assert_allclose(ref[:43], _mlx_logits(vlm, prompt), atol=1e-5, rtol=0)  # mlx-vlm: chunks = one pass
