"""The image path's tensors (VISION.md §V.F): inventory counts and sizes at release width, the tiny writer and
the loader (round trip, refusals by name), and the sharding rule table covering every vision parameter."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from dsv41_jax import param_specs
from dsv41_jax.checkpoint import CheckpointError, load_checkpoint
from dsv41_jax.config import ConfigError, ModelConfig, load_named
from dsv41_jax.make_tiny import random_weights, write_checkpoint
from sharding.rules import matching_rules, param_spec

TINY_V = load_named("tiny_vision")


def test_release_inventory_matches_spec_counts():
    cfg = load_named("dsv41_flash")
    specs = param_specs.vision_tensors(cfg)
    names = [s.name for s in specs]

    def params(prefix):
        return sum(math.prod(s.shape) for s in specs if s.name.startswith(prefix))

    assert sum(n.startswith("vision.") for n in names) == 259  # 2 + 32·8 + 1
    assert sum(n.startswith("aligner.") for n in names) == 4 and sum(n.startswith("image_") for n in names) == 3
    assert (params("vision."), params("aligner."), params("image_")) == (411_842_560, 73_410_560, 15_360)
    assert sum(n.endswith(".gate.bias_vl") for n in names) == 40
    assert all(s.stored == ("f32" if s.name.endswith("bias_vl") else "bf16") for s in specs)
    # Text-only inventories (the planner's byte counts) are unchanged by a vision_config.
    assert not set(names) & set(param_specs.model_tensors(cfg))
    assert set(param_specs.model_tensors(cfg, vision=True)) == set(param_specs.model_tensors(cfg)) | set(names)


def test_vision_config_both_namings_and_disabled():
    flat = {k: v for k, v in TINY_V.to_dict().items() if k != "vision_config"}
    flat.update(vision_n_layers=2, vision_dim=64, vision_n_heads=2, vision_inter_dim=96, vision_max_n_token=64,
                vision_min_pixels=3136)
    assert ModelConfig.from_dict(flat) == TINY_V
    off = {**TINY_V.to_dict(), "vision_config": {**TINY_V.vision.to_dict(), "num_hidden_layers": 0}}
    assert ModelConfig.from_dict(off).vision is None
    with pytest.raises(ConfigError, match="head dim"):
        ModelConfig.from_dict({**TINY_V.to_dict(), "vision_config": {"hidden_size": 64, "num_attention_heads": 3}})


def test_tiny_writer_and_loader_round_trip(tmp_path):
    weights = random_weights(TINY_V, seed=5)
    text = random_weights(load_named("tiny"), seed=5)
    assert all(np.array_equal(text[k], weights[k]) for k in text)  # vision tensors are drawn after the text ones
    stored = write_checkpoint(tmp_path, TINY_V, weights, "fp4")
    _, flat = load_checkpoint(tmp_path, vision=True, progress=False)
    assert set(flat) == set(param_specs.model_tensors(TINY_V, vision=True))
    for name in param_specs.model_tensors(TINY_V, vision=True):
        if name.startswith(("vision.", "aligner.", "image_")) or name.endswith("bias_vl"):
            np.testing.assert_array_equal(flat[name], stored[name])
            np.testing.assert_array_equal(flat[name], weights[name])  # plain bf16 / f32: stored exactly
    _, text_only = load_checkpoint(tmp_path, progress=False)  # without the image path they are skipped
    assert not any(n.startswith("vision.") or n.endswith("bias_vl") for n in text_only)
    # A checkpoint missing a vision tensor is refused by name when the image path is asked for.
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["aligner.w2.bias"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="aligner.w2.bias"):
        load_checkpoint(tmp_path, vision=True, progress=False)


def test_text_checkpoint_cannot_read_images(tmp_path):
    cfg = load_named("tiny")
    write_checkpoint(tmp_path, cfg, random_weights(cfg, 0), "none")
    with pytest.raises(CheckpointError, match="no vision_config"):
        load_checkpoint(tmp_path, vision=True, progress=False)


# The tower's split tensors (VISION.md §V.G, sharding/rules.py): column-parallel wqkv / mlp.w1 / aligner.w1
# (+ their biases), row-parallel wo / mlp.w2 / aligner.w2; everything else of the image path replicated.
_SPLIT = re.compile(r"vision\.blocks\.\d+\.(attn\.wqkv\.(weight|bias)|attn\.wo\.weight|mlp\.w[12]\.weight)"
                    r"|aligner\.w1\.(weight|bias)|aligner\.w2\.weight")


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_every_vision_parameter_has_one_rule(layout):
    for name, shape in param_specs.model_tensors(TINY_V, vision=True).items():
        assert len(matching_rules(name)) == 1, name
        if not (name.startswith(("vision.", "aligner.", "image_")) or name.endswith("bias_vl")):
            continue
        spec = param_spec(name, len(shape), layout)
        assert any(a is not None for a in spec) == bool(_SPLIT.fullmatch(name)), (name, spec)
