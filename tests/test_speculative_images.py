"""DSpark speculation after image prompts (issue 17's left item): the prompt segments take their image rows as
the engine's prefill does, so greedy with speculation equals the engine's plain greedy for a batch that mixes an
image prompt (two images, spans crossing segment boundaries) and a text prompt.

Same tiny vision model both ways (random init, f32, rounding points off: the comparison is exact up to f32
summation order, as in `tests/test_speculative.py`). The drafts are the stages' own (random weights: mostly
rejected) and then forced to the reference tokens (every round accepts all), so both the reject and the
accept-all paths run after an image prefill. A control shows the test can fail: the same ids with other pixels
(a second noise image of the same size) decode differently.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from PIL import Image
from test_speculative import MAX_CONTEXT, _oracle, _same, stage_drafts  # tests/ is on sys.path

from dsv41_jax.config import load_named
from dsv41_jax.engine import Engine, Request, fixed_segments
from dsv41_jax.model.transformer import ModelOptions, Transformer
from dsv41_jax.speculative import Speculator
from dsv41_jax.vision.preprocess import expand_prompt, load_image, prepare_image

FIXTURE = Path(__file__).parent / "fixtures" / "test_image.png"


@pytest.fixture(scope="module")
def setup():
    cfg = load_named("tiny_vision").replace(
        num_hidden_layers=5, compress_ratios=(0, 2, 1, 1, 1, 0, 0, 0), kv_source_layer_ids=(1, 2),
        index_source_layer_ids=(1, 2, 3), candidate_source_layer_id=2, dspark_target_layer_ids=(2, 3, 4))
    options = ModelOptions(dtype="float32", quant_rounding=False, dspark=True, vision=True)
    model = Transformer(cfg, options, rngs=nnx.Rngs(4))
    engine = Engine(model, cfg, max_context=MAX_CONTEXT, cache_dtype="float32", eos_ids=(),
                    segment_plan=lambda n: fixed_segments(n, 16), short_rows=0)
    ids = (0, 17, 42, 99, 7, cfg.image_token_id, 5, 6, 300, 11, cfg.image_token_id, 12, 13, 14, 15, 16, 200)
    prompt, other = (expand_prompt(ids, [load_image(FIXTURE, cfg.vision), _noise(seed, cfg)], cfg.image_token_id)
                     for seed in (9, 10))
    assert other.ids == prompt.ids  # same image sizes: the control differs in pixels only
    text = tuple(int(t) for t in np.random.default_rng(1).integers(3, 400, 21))
    requests = [Request(prompt.ids, 24, images=prompt), Request(text, 19)]
    return cfg, engine, Speculator(engine), requests, engine.generate(requests), other


def _noise(seed: int, cfg):
    noise = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (300, 30, 3), dtype=np.uint8))
    return prepare_image(noise, cfg.vision)


@pytest.mark.slow  # speculation after image prompts: a mode beyond either path alone
def test_greedy_after_image_prompts_matches_plain_greedy(setup):
    cfg, engine, spec, requests, reference, other = setup
    # The stages' own drafts through the forced run's round program (one round compile, not two; the round takes
    # no image input: tests/test_speculative.py's `stage_drafts`).
    _same(spec.generate(requests, 5, oracle=stage_drafts(requests, reference)), reference)
    ref = _oracle(requests, reference)  # forced accept-all: the drafts are the reference tokens
    out = spec.generate(requests, 5, oracle=(ref, np.ones(ref.shape, bool)))
    _same(out, reference)
    assert out.timings.tokens_per_round > 3.0
    # control: other pixels in the second image (same ids, same batch: the reference's compiled programs) decode
    # the first prompt differently, so the images reach the model
    control = engine.generate([Request(other.ids, 24, images=other), requests[1]])
    assert control.timings.programs_compiled == 0
    assert control.generations[0].token_ids != reference.generations[0].token_ids
    assert control.generations[1].token_ids == reference.generations[1].token_ids
