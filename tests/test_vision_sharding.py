"""Image prompts on a sharded model: worlds 2 and 4 against one device (simulated CPU devices, tests/conftest.py).

Reference: the plain one-device ``Transformer`` (``build_model``) through the same ``Engine``; its image path is
checked against mlx-vlm in ``test_vision_model.py``. Both run f32 with the rounding points off (MODEL.md §C.4).

TINY-V's tower has 2 heads and MLP width 96, so world 2 splits heads and MLP columns evenly and world 4 pads
the heads (2 real heads over 4 ranks: two ranks hold one zero head each, VISION.md §V.G) while its MLP splits
evenly (24 columns a rank).

Tolerances: aligner rows 1e-5 absolute on values of size ~2 (the only difference is the order of f32 sums:
per-rank partial sums of ``attn.wo``, ``mlp.w2`` and ``aligner.w2`` all-reduced; observed ≤ 1e-6). Prefill and
decode logits 1e-4 absolute on logits of size ~4, as ``test_sharding_model.py`` (the layers amplify last-bit
differences to a few 1e-6). Greedy tokens identical.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from PIL import Image

import sharding
from dsv41_jax.checkpoint import open_checkpoint
from dsv41_jax.config import load_named
from dsv41_jax.engine import Engine, Request
from dsv41_jax.loading import build_model
from dsv41_jax.make_tiny import random_weights, write_checkpoint
from dsv41_jax.model.transformer import ModelOptions
from dsv41_jax.vision.batch import build_batch
from dsv41_jax.vision.preprocess import expand_prompt, load_image, prepare_image
from sharding.load import checkpoint_source

FIXTURE = Path(__file__).parent / "fixtures" / "test_image.png"
# TINY-V cut to 4 text layers (a window layer, two compressed layers, the indexer): a third of the compile time.
CFG = load_named("tiny_vision").replace(
    num_hidden_layers=4, compress_ratios=(0, 0, 2, 2), kv_source_layer_ids=(2,), index_source_layer_ids=(2,),
    candidate_source_layer_id=-1, num_nextn_predict_layers=0, dspark_target_layer_ids=())
F32 = ModelOptions(dtype="float32", quant_rounding=False, vision=True)
CHUNKS = [43]  # one segment (spans crossing segments: test_vision_model.py at world 1)
NEW = 2
_cache: dict = {}


def _prompt():
    """Text, image (fixture, span 10), text, image (30×300, span 18), text: 43 positions."""
    rng = np.random.default_rng(9)
    tall = Image.fromarray(rng.integers(0, 256, (300, 30, 3), dtype=np.uint8))
    images = [load_image(FIXTURE, CFG.vision), prepare_image(tall, CFG.vision)]
    ids = (0, 17, 42, 99, 7, CFG.image_token_id, 5, 6, 300, 11, CFG.image_token_id, 12, 13, 14, 15, 16, 200)
    return expand_prompt(ids, images, CFG.image_token_id)


def _weights():
    if "flat" not in _cache:
        flat = random_weights(CFG, seed=3)
        for layer in range(CFG.num_hidden_layers):  # image rows route to experts 0 and 1 (bias_vl visible)
            flat[f"layers.{layer}.ffn.gate.bias_vl"][:2] += 10.0
        _cache["flat"] = flat
    return _cache["flat"]


def _run(model, mesh):
    """(aligner rows of the prompt's images [2, M, D], prefill logits [43, V], greedy tokens, decode logits)."""
    prompt = _prompt()
    engine = Engine(model, CFG, max_context=64, cache_dtype="float32", short_rows=0, mesh=mesh,
                    segment_plan=lambda n: CHUNKS)
    request = Request(prompt.ids, max_new_tokens=NEW, images=prompt)
    # the engine's one tower call: [2·M, D]
    table = np.asarray(engine.runtime.encode_images([request.images], len(request.prompt_ids))[0])
    result = engine.generate([request], record_logits=True)
    return (table.reshape(len(prompt.images), -1, table.shape[-1]), result.prefill_logits,
            result.generations[0].token_ids, result.decode_logits)


def _reference():
    if "ref" not in _cache:
        _cache["ref"] = _run(build_model(CFG, F32, _weights()), None)
    return _cache["ref"]


@pytest.mark.devices
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # world 4's split: the test below
def test_image_prompt_at_world_matches_one_device(world):
    ref_rows, ref_logits, ref_tokens, ref_decode = _reference()
    model, mesh = sharding.prepare(CFG, _weights(), world, F32)
    rows, logits, tokens, decode = _run(model, mesh)
    prompt = _prompt()
    for k, im in enumerate(prompt.images):
        np.testing.assert_allclose(rows[k, : im.plan.n_tokens], ref_rows[k, : im.plan.n_tokens], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=0)
    np.testing.assert_allclose(decode, ref_decode, atol=1e-4, rtol=0)
    assert tokens == ref_tokens


@pytest.mark.devices(4)
def test_tower_weights_are_split_and_padded_at_world_4(tmp_path):
    """World 4 of TINY-V (2 heads of 32, MLP 96, D 64): each rank holds one head's q, k, v rows (ranks 2 and 3 a
    zero head), 24 MLP columns' gate and up rows, 16 aligner columns; the real entries are the checkpoint's,
    read lazily (each rank's rows of each fused part) from a written checkpoint. The compiled tower moves no
    weight: its only collectives are the all-reduces after ``wo`` and ``mlp.w2`` (once in the scan's body) and
    after ``aligner.w2``."""
    flat = _weights()
    write_checkpoint(tmp_path, CFG, flat, "none")
    model, mesh = sharding.prepare(CFG, checkpoint_source(open_checkpoint(tmp_path, vision=True)), 4, F32)
    shapes = {"vision.blocks.0.attn.wqkv.weight": (3 * 32, 64), "vision.blocks.0.attn.wo.weight": (64, 32),
              "vision.blocks.1.mlp.w1.weight": (2 * 24, 64), "vision.blocks.1.mlp.w2.weight": (64, 24),
              "aligner.w1.weight": (16, 9 * 64), "aligner.w2.weight": (64, 16), "vision.norm.weight": (64,)}
    state = dict((".".join(map(str, p)), v[...]) for p, v in nnx.to_flat_state(nnx.state(model.inner, nnx.Param)))
    for name, shard_shape in shapes.items():
        assert {s.data.shape for s in state[name].addressable_shards} == {shard_shape}, name
    wqkv = state["vision.blocks.0.attn.wqkv.weight"]
    for device in mesh.devices.flat[2:]:
        assert not np.asarray(next(s.data for s in wqkv.addressable_shards if s.device == device)).any()
    for name, value in state.items():
        if name.startswith(("vision.", "aligner.")):
            hit = sharding.rules.split_axis(name, value.ndim, "tp")
            value = np.asarray(value)
            if hit is not None:
                value = np.take(value, model.plan.split(hit[1], value.shape[hit[0]]).real_index(), axis=hit[0])
            np.testing.assert_array_equal(value, flat[name], err_msg=name)
    batch = build_batch(_prompt().images[:1], CFG.vision)  # 64 patches, 16 rows
    graphdef, state = nnx.split(model)
    rep = sharding.replicated(mesh)
    hlo = jax.jit(lambda st, b: nnx.merge(graphdef, st).encode_images(b),
                  in_shardings=(sharding.state_sharding(model), rep), out_shardings=rep).lower(state, batch).compile()
    found = collectives(hlo.as_text())
    assert found == [("all-reduce", "f32[1,64,64]")] * 2 + [("all-reduce", "f32[1,16,64]")], found


def collectives(hlo: str) -> list[tuple[str, str]]:
    """(op, result shape without layout) of every collective in a compiled program."""
    pattern = r"= (\([^)]*\)|\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
    return [(op, re.sub(r"\{.*", "", shape)) for shape, op in re.findall(pattern, hlo)]
