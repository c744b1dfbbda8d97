"""Engram and image prompts together, end to end against mlx-vlm 0.7.10 (its language model hashes n-grams with
image spans marked dead and gates engram off at image rows; its vision tower and aligner are its own).

A tiny checkpoint with both (`tiny_vision` plus the engram layer of `tiny_engram`), float32 and rounding points off
on both sides (as tests/test_vision_model.py and tests/test_engram_engine.py, whose tolerance 1e-4 on logits of
size ~4 this shares: summation order only). The engine's segments cut both image spans, so the engram history the
engine carries on the host crosses segment boundaries inside a span (dead rows) and into text after it; two decode
steps follow. The control shows the engram layer moves these logits by far more than the tolerance.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from mlx_vlm_vision_oracle import HAVE_MLX_VLM

if not HAVE_MLX_VLM:
    pytest.skip("mlx-vlm (test extra) is not installed", allow_module_level=True)
import mlx.nn as nn
from mlx_vlm_oracle import load_vlm_model
from mlx_vlm_vision_oracle import fake_quant_off, vlm_prefill

from dsv41_jax.checkpoint import load_checkpoint
from dsv41_jax.config import load_named
from dsv41_jax.engine import Engine, Request
from dsv41_jax.engram import Hasher
from dsv41_jax.loading import build_model
from dsv41_jax.make_tiny import random_weights, write_checkpoint
from dsv41_jax.model.transformer import ModelOptions
from dsv41_jax.vision.preprocess import expand_prompt, load_image

_ENGRAM = ("engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim",
           "engram_vocab_size", "engram_compressed_vocab_size", "engram_pad_token_id")
CFG = load_named("tiny_vision").replace(**{k: getattr(load_named("tiny_engram"), k) for k in _ENGRAM})
FIXTURE = Path(__file__).parent / "fixtures" / "test_image.png"
SEGMENTS = [12, 12, 13]  # cuts at 12 (inside the first span, 5…14) and 24 (inside the second, 21…30)
ATOL = 1e-4


def _ids(extra=()):
    """Text with repeated n-grams around two images (spans of 10): the same n-grams recur across the spans."""
    img = CFG.image_token_id
    return (40, 41, 42, 43, 44, img, 40, 41, 42, 43, 44, 45, img, 40, 41, 42, 43, 44, 46, *extra)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("engram_images")
    weights = random_weights(CFG, seed=5)
    write_checkpoint(path, CFG, weights, "none")
    _, flat = load_checkpoint(path, vision=True, progress=False)
    model = build_model(CFG, ModelOptions(dtype="float32", quant_rounding=False, vision=True), flat)
    engine = Engine(model, CFG, max_context=64, cache_dtype="float32", short_rows=0,
                    segment_plan=lambda n: SEGMENTS, hasher=Hasher(CFG, checkpoint_dir=path))
    vlm = load_vlm_model(path)
    vlm.aligner.act = nn.GELU(approx="none")  # VISION.md §V.D's exact GELU (see mlx_vlm_vision_oracle)
    image = load_image(FIXTURE, CFG.vision)
    return engine, vlm, image


def _mlx_logits(vlm, prompt, chunks):
    records = [(s, im.patches, im.plan.Hv, im.plan.Wv, prompt.roles[s: s + im.plan.span_len])
               for s, im in zip(prompt.starts, prompt.images)]
    with fake_quant_off():
        return vlm_prefill(vlm, prompt.ids, records, chunks)


@pytest.mark.slow  # engram beside image prompts: each is checked against mlx-vlm alone in make test
def test_engram_with_image_prompts_matches_mlx_vlm(setup):
    engine, vlm, image = setup
    prompt = expand_prompt(_ids(), [image, image], CFG.image_token_id)
    assert len(prompt.ids) == 37 and prompt.starts == (5, 21) and CFG.engram_layer_ids
    result = engine.generate([Request(prompt.ids, max_new_tokens=3, images=prompt)], record_logits=True)
    tokens = result.generations[0].token_ids
    longer = expand_prompt(_ids(tokens[:2]), [image, image], CFG.image_token_id)
    ref = _mlx_logits(vlm, longer, SEGMENTS + [1, 1])
    err_p = np.abs(result.prefill_logits - ref[:37]).max()
    err_d = np.abs(result.decode_logits - ref[36:]).max()
    print(f"\nengine vs mlx-vlm, engram + images: prefill max|Δ| {err_p:.2e}, decode max|Δ| {err_d:.2e}")
    assert err_p < ATOL and err_d < ATOL
    assert tokens[:2] == tuple(int(t) for t in np.argmax(ref[36:38], axis=-1))
    # Control: mlx-vlm without its engram hashes (the layer is skipped) is far from both.
    lm = vlm.language_model
    saved = lm.engram_hash, lm._engram_source
    lm.engram_hash, lm._engram_source = None, None
    try:
        without = _mlx_logits(vlm, longer, SEGMENTS + [1, 1])
    finally:
        lm.engram_hash, lm._engram_source = saved
    assert np.abs(without - ref).max() > 100 * ATOL
