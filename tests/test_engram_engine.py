"""The engine runs engram end to end: host hashing per call with the history it carries across prefill segments
(long ones as one call, short ones row by row) and decode steps, against mlx-vlm's logits (tests/mlx_vlm_oracle.py)
on a TINY-E checkpoint; and ``generate`` runs it by default from a checkpoint directory.

Float32 with every rounding point off on both sides (the engine's model is built with ``quant_rounding=False``):
tolerance 1e-4 on logits of size ~4, as in tests/test_engram_parity.py (same math, summation order only).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv41_jax import generate
from dsv41_jax.checkpoint import load_checkpoint
from dsv41_jax.config import load_named
from dsv41_jax.engine import Engine, Request
from dsv41_jax.engram import Hasher
from dsv41_jax.loading import build_model
from dsv41_jax.make_tiny import random_weights, write_checkpoint
from dsv41_jax.model import ModelOptions
from dsv41_jax.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
mlx_vlm_oracle = pytest.importorskip("mlx_vlm_oracle")
if not mlx_vlm_oracle.HAVE_MLX_VLM:
    pytest.skip("mlx-vlm (test extra) is not installed", allow_module_level=True)

SEGMENTS = [20, 5, 23]  # 20 → one 32-row call; 5 → five one-row calls; 23 → one 32-row call
NEW = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = load_named("tiny_engram")
    path = tmp_path_factory.mktemp("engram_engine")
    write_checkpoint(path, cfg, random_weights(cfg, 1), "fp4")
    rng = np.random.default_rng(11)
    base = rng.integers(3, cfg.image_token_id, 16)
    prompt = np.concatenate([base, base[4:12], base, base[:8]])  # 48 ids, repeated n-grams
    return path, prompt


def test_engine_segments_and_decode_match_mlx_vlm(checkpoint):
    path, prompt = checkpoint
    cfg, flat = load_checkpoint(path, progress=False)
    model = build_model(cfg, ModelOptions(dtype="float32", quant_rounding=False), flat)
    engine = Engine(model, cfg, max_context=64, cache_dtype="float32", segment_plan=lambda n: SEGMENTS,
                    hasher=Hasher(cfg, checkpoint_dir=path))
    result = engine.generate([Request(tuple(int(t) for t in prompt), NEW, SamplingParams(0.0))], record_logits=True)
    ref = mlx_vlm_oracle.vlm_reference(path, prompt, NEW)
    assert list(result.generations[0].token_ids) == ref["tokens"].tolist()
    err_p = np.abs(result.prefill_logits - ref["prefill"]).max()
    # decode_logits[i] drew token i: row 0 is the last prompt row, row i ≥ 1 came after feeding token i − 1
    err_d = np.abs(result.decode_logits[1:] - ref["decode"][:NEW - 1]).max()
    print(f"\nengine vs mlx-vlm: prefill max|Δ| {err_p:.2e}, decode max|Δ| {err_d:.2e}")
    assert err_p < 1e-4 and err_d < 1e-4


@pytest.mark.slow  # generate with engram: the shipped model (engram layer) runs it in test_trained_model and make run
def test_generate_runs_engram_from_a_checkpoint(checkpoint, tmp_path, capsys):
    """``generate`` with its defaults (rounding points on, bf16) on a checkpoint with an engram layer: the layer
    runs (its tables are reported; no skip warning) and the greedy tokens are the argmax of the recorded logits."""
    path, prompt = checkpoint
    out = tmp_path / "run.npz"
    assert generate.main(["--checkpoint", str(path), "--prompt-ids", ",".join(map(str, prompt[:24])), "--greedy",
                          "--max-new-tokens", "3", "--json", "--logits-out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "engram layers [1]: tables on the devices" in captured.err and "NOT the model's" not in captured.err
    result = json.loads(captured.out)["results"][0]
    saved = np.load(out)
    assert result["generated_ids"] == saved["decode"].argmax(-1).tolist() == saved["tokens"].tolist()
