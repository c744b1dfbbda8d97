"""Engram in the model (`MODEL.md` §B.12) against mlx-vlm's independent ``deepseek_v41`` (tests/mlx_vlm_oracle.py),
on random TINY-E checkpoints (`MODEL.md` §A.3) with one engram layer (1) and with two (1 and 6), written by
``make_tiny`` in the release layout (fp8 dense, fp4 experts, e4m3 tables with ue8m0 scales) and loaded by each
side through its own loader; mlx-vlm hashes with its own code from the checkpoint's ``engram_token_map.json``.

Prompts repeat n-grams (so repeated 2/3/4-grams hit the same table rows), avoid the image id (mlx-vlm would
treat it as an image position) and run as a ragged batch of 56 and 40 tokens, then 6 decode steps
teacher-forced with mlx-vlm's greedy tokens. One compiled program ``[2, 56]`` serves prefill, chunked prefill
and decode (a decode step is a call with one real row), so each config compiles once.

Tolerance, float32 with every rounding point off on both sides (mlx-vlm's fp8 GEMM-input rounding included,
`mlx_vlm_oracle.rounding_off`): 1e-4 absolute on logits of size ~4, as the mlx-lm text parity tests — both
sides compute the same f32 math, differing in GEMM summation order and transcendental last bits (~1e-7
relative) amplified through 10 layers (observed ≤ 1e-5). The engram term itself is large: dropping it moves
these logits by O(1) (checked below), so this tolerance pins it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import sharding
from dsv41_jax import engram
from dsv41_jax.checkpoint import load_checkpoint
from dsv41_jax.config import load_named
from dsv41_jax.loading import build_model
from dsv41_jax.make_tiny import random_weights, write_checkpoint
from dsv41_jax.model import EngramInput, ModelOptions, init_cache

sys.path.insert(0, str(Path(__file__).parent))
mlx_vlm_oracle = pytest.importorskip("mlx_vlm_oracle")
if not mlx_vlm_oracle.HAVE_MLX_VLM:
    pytest.skip("mlx-vlm (test extra) is not installed", allow_module_level=True)

OPTIONS = ModelOptions(dtype="float32", quant_rounding=False)
ROWS, DECODE, MAX_CONTEXT = 56, 6, 64
LENGTHS = (56, 40)
ATOL = 1e-4


def two_layer_config():
    """TINY-E with engram on layers 1 and 6 (a window layer and the ratio-1 candidate source)."""
    cfg = load_named("tiny_engram").replace(engram_layer_ids=(1, 6), engram_num_embeddings=(0, 0))
    return cfg.replace(engram_num_embeddings=tuple(int(s) for s in engram.layer_primes(cfg).sum(axis=1)))


def prompts(cfg, seed: int) -> list[np.ndarray]:
    """Two prompts (56 and 40 ids) that repeat n-grams; no image id."""
    rng = np.random.default_rng(seed)
    out = []
    for n in LENGTHS:
        base = rng.integers(3, cfg.image_token_id, 20)
        ids = np.concatenate([base, base[5:15], base, base[2:8]])[:n]
        out.append(ids)
    return out


class EngramRunner:
    """Feeds segments of a batch through one jitted ``[B, ROWS]`` forward, hashing on the host with the
    carried history (as the engine does)."""

    def __init__(self, cfg, state, fn, ckpt_dir, batch=2, gate_open=True):
        self.cfg, self.state, self.fn, self.batch, self.gate_open = cfg, state, fn, batch, gate_open
        self.hasher = engram.Hasher(cfg, checkpoint_dir=ckpt_dir)
        self.history = engram.empty_history(cfg, batch)
        self.cache = init_cache(cfg, batch, MAX_CONTEXT, "float32")

    def step(self, segments):
        ids = np.full((self.batch, ROWS), 2, np.int32)
        lengths = np.array([len(s) for s in segments], np.int32)
        for b, seg in enumerate(segments):
            ids[b, :len(seg)] = seg
        rows, self.history = self.hasher.rows(ids, self.history, lengths=lengths)
        text = np.full(ids.shape, self.gate_open)
        logits, self.cache = self.fn(self.state, ids, self.cache, lengths, rows.astype(np.int32), text)
        logits = np.asarray(logits)
        return [logits[b, :n] for b, n in enumerate(lengths)]

    def run(self, ids_per_seq, chunks_per_seq, decode_tokens):
        """Prefill each sequence in its chunks (all sequences in the same calls), then decode the given tokens
        ([steps, B]) one a call. Returns per sequence (prefill [n, V], decode [steps, V])."""
        prefill = [[] for _ in ids_per_seq]
        starts = [0] * len(ids_per_seq)
        for i in range(max(len(c) for c in chunks_per_seq)):
            segs = []
            for b, chunks in enumerate(chunks_per_seq):
                n = chunks[i] if i < len(chunks) else 0
                segs.append(ids_per_seq[b][starts[b]:starts[b] + n])
                starts[b] += n
            for b, out in enumerate(self.step(segs)):
                prefill[b].append(out)
        decode = [self.step([np.array([t]) for t in toks]) for toks in decode_tokens]
        return [(np.concatenate(prefill[b]), np.array([d[b][0] for d in decode])) for b in range(len(ids_per_seq))]


def forward(graphdef, in_shardings=None):
    """jit(state, ids, cache, lengths, rows, text) -> (logits, cache); text [B, T] False closes the gate."""
    def run(state, ids, cache, lengths, rows, text):
        return nnx.merge(graphdef, state)(ids, cache, lengths, engram=EngramInput(rows, text))

    return jax.jit(run) if in_shardings is None else jax.jit(run, in_shardings=in_shardings)


@pytest.fixture(scope="module", params=["one", pytest.param("two", marks=pytest.mark.slow)])
def case(request, tmp_path_factory):
    """(name, dir, cfg, flat, prompts, mlx-vlm references per prompt)."""
    cfg = load_named("tiny_engram") if request.param == "one" else two_layer_config()
    path = tmp_path_factory.mktemp(f"engram_{request.param}")
    # Weight seed 3 with these prompts hits an exact-looking divergence from position 59 on (3.3 on the logits,
    # both sides self-consistent across chunkings and decode; seeds 3/8, 4/7, 5/9 all agree to 6e-6): a near-tied
    # selection (top-k / candidate / expert tie-breaking differs, MODEL.md §G.5) — seed 4 avoids it.
    write_checkpoint(path, cfg, random_weights(cfg, 0 if request.param == "one" else 4), "fp4")
    loaded_cfg, flat = load_checkpoint(path, progress=False)
    ids = prompts(cfg, 7)
    refs = [mlx_vlm_oracle.vlm_reference(path, p, DECODE) for p in ids]
    return request.param, path, loaded_cfg, flat, ids, refs


@pytest.fixture(scope="module")
def runs(case):
    """Ours on one device: one-pass ragged prefill + decode, and chunked prefill + decode."""
    name, path, cfg, flat, ids, refs = case
    graphdef, state = nnx.split(build_model(cfg, OPTIONS, flat))  # no random init first (3 s a config)
    fn = forward(graphdef)
    tokens = np.stack([r["tokens"] for r in refs], axis=1)  # [steps, B]
    one_pass = EngramRunner(cfg, state, fn, path).run(ids, [[len(p)] for p in ids], tokens)
    chunked = EngramRunner(cfg, state, fn, path).run(ids, [[17, 5, 34], [9, 1, 20, 10]], tokens)
    closed = EngramRunner(cfg, state, fn, path, gate_open=False).run(ids, [[len(p)] for p in ids], tokens[:0])
    return {"one_pass": one_pass, "chunked": chunked, "gate_closed": closed}


def test_matches_mlx_vlm_prefill_and_decode(case, runs):
    name, _, cfg, flat, ids, refs = case
    for b, ((prefill, decode), ref) in enumerate(zip(runs["one_pass"], refs, strict=True)):
        err_p = np.abs(prefill - ref["prefill"]).max()
        err_d = np.abs(decode - ref["decode"]).max()
        print(f"\n{name} seq {b} ({len(ids[b])} ids): prefill max|Δ| {err_p:.2e}, decode max|Δ| {err_d:.2e}")
        assert err_p < ATOL and err_d < ATOL
        rows = np.concatenate([ref["prefill"][-1:], ref["decode"][:-1]])
        top2 = np.sort(rows, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-3
        ours = np.concatenate([prefill[-1:], decode[:-1]]).argmax(-1)
        assert (ours[clear] == ref["tokens"][clear]).all()


def test_engram_term_is_large(case, runs):
    """With every gate closed (text = False: what an image position gets, VISION.md §V.E.4) the logits are far
    from mlx-vlm's: the tolerance above pins the engram term, not noise."""
    refs = case[-1]
    for (prefill, _), ref in zip(runs["gate_closed"], refs, strict=True):
        assert np.median(np.abs(prefill - ref["prefill"]).max(-1)) > 0.1


def test_chunked_prefill_equals_one_pass(case, runs):
    """Segments 17/5/34 and 9/1/20/10 (ragged, both sequences in the same calls) with the carried engram history
    = one pass (f32, rounding off: summation order only, MODEL.md §D.4)."""
    for (p1, d1), (p2, d2) in zip(runs["one_pass"], runs["chunked"], strict=True):
        np.testing.assert_allclose(p2, p1, rtol=0, atol=1e-5)
        np.testing.assert_allclose(d2, d1, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_worlds_equal_one_device(case, runs, world):
    """Sharded over 2 and 4 simulated devices (engram tables split by hash column, sharding/rules.py) = one
    device (f32 sums reordered by the all-reduces only; same 1e-4 as tests/test_sharding_model.py)."""
    name, path, cfg, flat, ids, refs = case
    if name == "one":
        pytest.skip("the two-layer config covers the sharded engram path")
    model, mesh = sharding.prepare(cfg, flat, world, OPTIONS)
    graphdef, state = nnx.split(model)
    rep = sharding.replicated(mesh)
    shardings = (sharding.state_sharding(model), rep, sharding.cache_sharding(mesh, init_cache(
        cfg, 2, MAX_CONTEXT, "float32")), rep, rep, rep)
    tokens = np.stack([r["tokens"] for r in refs], axis=1)
    runner = EngramRunner(cfg, state, forward(graphdef, shardings), path)
    # The first call's cache already placed as the program takes it: its later calls pass the cache it returns,
    # and an unplaced first cache would make jit trace and lower the program a second time.
    runner.cache = jax.device_put(runner.cache, shardings[2])
    got = runner.run(ids, [[len(p)] for p in ids], tokens)
    for (p1, d1), (p2, d2) in zip(runs["one_pass"], got, strict=True):
        np.testing.assert_allclose(p2, p1, rtol=0, atol=ATOL)
        np.testing.assert_allclose(d2, d1, rtol=0, atol=ATOL)
