"""Image prompts through the slot engine: prefilled apart (never row by row), the tower once a request, each segment
with its slice of the image rows (spans crossing segment boundaries), decode steps text; tokens equal
`Engine.generate` of the request alone, beside a short and a long text prompt. A control shows the images reach
the model: the same ids with other pixels decode differently. Image prompts are never prefix-cached.

Model: tests/test_speculative_images.py's 5-layer cut of the tiny vision config (random init, float32, rounding
points off), 16-row segments, ``short_rows`` 8.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flax import nnx
from PIL import Image

from dsv41_jax.config import load_named
from dsv41_jax.engine import Engine, EngineInputError, Request, fixed_segments
from dsv41_jax.model.transformer import ModelOptions, Transformer
from dsv41_jax.sampling import SamplingParams
from dsv41_jax.serve.prefix import PrefixCache
from dsv41_jax.serve.slots import Job, SlotEngine
from dsv41_jax.vision.preprocess import expand_prompt, load_image, prepare_image

FIXTURE = Path(__file__).parent / "fixtures" / "test_image.png"


@pytest.fixture(scope="module")
def setup():
    cfg = load_named("tiny_vision").replace(
        num_hidden_layers=5, compress_ratios=(0, 2, 1, 1, 1, 0, 0, 0), kv_source_layer_ids=(1, 2),
        index_source_layer_ids=(1, 2, 3), candidate_source_layer_id=2, num_nextn_predict_layers=0,
        dspark_target_layer_ids=())
    model = Transformer(cfg, ModelOptions(dtype="float32", quant_rounding=False, vision=True), rngs=nnx.Rngs(4))
    engine = Engine(model, cfg, max_context=160, cache_dtype="float32", eos_ids=(),
                    segment_plan=lambda n: fixed_segments(n, 16), short_rows=8)
    ids = (0, 17, 42, 99, 7, cfg.image_token_id, 5, 6, 300, 11, cfg.image_token_id, 12, 13, 14, 15, 16, 200)
    prompt, other = (expand_prompt(ids, [load_image(FIXTURE, cfg.vision), _noise(seed, cfg)], cfg.image_token_id)
                     for seed in (9, 10))
    assert other.ids == prompt.ids and len(prompt.ids) > 32  # same sizes, other pixels; several segments
    return cfg, engine, prompt, other


def _noise(seed: int, cfg):
    noise = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (300, 30, 3), dtype=np.uint8))
    return prepare_image(noise, cfg.vision)


def _run(slots: SlotEngine, requests) -> dict[int, tuple]:
    got: dict[int, list] = {i: [] for i in range(len(requests))}
    for i, r in enumerate(requests):
        slots.add(Job(i, r, lambda kind, value, i=i: got[i].append(value) if kind == "token" else None))
    while slots.busy:
        slots.step()
    return {i: tuple(t) for i, t in got.items()}


@pytest.mark.slow  # the image path through the slots: test_serve_image_parts runs it end to end through a real server
def test_image_prompts_in_slots_equal_generate_alone(setup):
    cfg, engine, prompt, other = setup
    rng = np.random.default_rng(2)
    text = tuple(int(t) for t in rng.integers(3, 400, 21))
    requests = [Request(prompt.ids, 10, images=prompt), Request((5, 6, 7), 12),
                Request(text, 8, SamplingParams(temperature=1.0, seed=3)), Request(other.ids, 10, images=other)]
    slots = SlotEngine(engine, 3, prefix_cache=PrefixCache(1 << 30))
    slots.precompile()
    got = _run(slots, requests)
    for i, r in enumerate(requests):
        assert got[i] == engine.generate([r]).generations[0].token_ids, i
    assert got[0] != got[3]  # the control: other pixels, other tokens
    # only the text prompt was looked up and stored (its one whole block)
    assert slots.prefix_cache.queries == len(text) and len(slots.prefix_cache) == 1


def test_an_image_prompt_needs_a_vision_model():
    from test_engine import mini_config  # noqa: PLC0415 - tests/ is on sys.path

    from dsv41_jax import make_tiny  # noqa: PLC0415
    from dsv41_jax.loading import build_model  # noqa: PLC0415

    cfg = mini_config()
    model = build_model(cfg, ModelOptions(dtype="float32", quant_rounding=False), make_tiny.random_weights(cfg, 0))
    engine = Engine(model, cfg, max_context=64, cache_dtype="float32", eos_ids=(),
                    segment_plan=lambda n: fixed_segments(n, 16), short_rows=8)
    slots = SlotEngine(engine, 1)
    with pytest.raises(EngineInputError, match="no vision tower"):
        slots.add(Job(0, Request((5, 6), 2, images=SimpleNamespace(ids=(5, 6))), lambda kind, value: None))
