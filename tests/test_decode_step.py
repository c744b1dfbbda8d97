"""The decode step: one program per token, logits only for the rows that need them (issues #14, #22).

Model: the 5-layer cut of the tiny config that keeps every layer role (as tests/test_engine.py), float32 with the
§C.2 rounding points off. The reference for "outputs unchanged" is the engine's recording path (``record_logits``:
the head over every row, checked against one plain forward in tests/test_engine.py); the paths under test (head on
one row per sequence, steps chained on the device, several queued) must give the same tokens, and their logits
the same values up to f32 GEMM summation order (``LOGIT_ATOL`` as tests/test_engine.py: 2e-4 on logits ~5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_events import backend_compiles
from flax import nnx
from test_engine import mini_config

from dsv41_jax import make_tiny
from dsv41_jax.config import load_named
from dsv41_jax.engine import Engine, Request, fixed_segments
from dsv41_jax.loading import build_model
from dsv41_jax.model.cache import init_cache
from dsv41_jax.model.transformer import ModelOptions
from dsv41_jax.sampling import SamplingParams

LOGIT_ATOL = 2e-4
MAX_CONTEXT = 48  # not tests/test_engine.py's 64: this file's programs (and their counts) are its own


@pytest.fixture(scope="module")
def setup():
    cfg = mini_config()
    model = build_model(cfg, ModelOptions(dtype="float32", quant_rounding=False), make_tiny.random_weights(cfg, 0))
    rng = np.random.default_rng(2)
    prompts = [tuple(int(t) for t in rng.integers(3, cfg.vocab_size, n)) for n in (21, 6)]
    return cfg, model, prompts


def make_engine(setup):
    cfg, model, _ = setup
    return Engine(model, cfg, max_context=MAX_CONTEXT, cache_dtype="float32", eos_ids=(),
                  segment_plan=lambda n: fixed_segments(n, 16), short_rows=8)


def test_head_on_selected_rows_equals_full_logits():
    """``logit_rows`` [B]: the head over one row per sequence gives those rows of the full [B,T,V] logits (a
    one-layer window model: the head and the row pick are what is tested, the layers only feed them)."""
    cfg = load_named("tiny").replace(
        num_hidden_layers=1, compress_ratios=(0,), kv_source_layer_ids=(), index_source_layer_ids=(),
        candidate_source_layer_id=-1, num_nextn_predict_layers=0, dspark_target_layer_ids=(), engram_layer_ids=())
    model = build_model(cfg, ModelOptions(dtype="float32", quant_rounding=False), make_tiny.random_weights(cfg, 0))
    graphdef, state = nnx.split(model)
    ids = np.random.default_rng(3).integers(3, cfg.vocab_size, (2, 12)).astype(np.int32)
    lengths, rows = np.array([12, 7], np.int32), np.array([11, 6], np.int32)

    @jax.jit
    def both(state, ids, lengths, rows):
        m = nnx.merge(graphdef, state)
        cache = init_cache(cfg, 2, MAX_CONTEXT, "float32")
        full, _ = m(ids, cache, lengths=lengths)
        picked, _ = m(ids, cache, lengths=lengths, logit_rows=rows)
        return full, picked

    full, picked = both(state, jnp.asarray(ids), jnp.asarray(lengths), jnp.asarray(rows))
    assert picked.shape == (2, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(picked), np.asarray(full)[np.arange(2), rows], atol=LOGIT_ATOL)


class _Counted:
    """A compiled program that counts its calls."""

    def __init__(self, fn, calls, name):
        self.fn, self.calls, self.name = fn, calls, name

    def __call__(self, *args):
        self.calls.append(self.name)
        return self.fn(*args)


def _count_calls(engine) -> list[str]:
    """Wrap every compiled program of the engine's table; returns the list their calls append names to."""
    calls: list[str] = []
    for key, fn in list(engine.runtime.table.compiled.items()):
        if not isinstance(fn, _Counted):
            engine.runtime.table.compiled[key] = _Counted(fn, calls, key[0])
    return calls


def _backend_compiles(fn):
    with backend_compiles() as compiles:
        out = fn()
    return out, compiles


def test_one_program_per_decode_step(setup):
    """A short prompt compiles two programs (the empty cache and the one-row step, which prefill row by row
    reuses); after that each new token is one call of the step program (no sampling program), and a second
    request with other sampling settings compiles nothing (counted by JAX's backend-compile events, as
    tests/test_engine.py does). A greedy request runs a step of its own, compiled once, with no sort in it."""
    _, _, prompts = setup
    engine = make_engine(setup)
    before = set(engine.runtime.table.compiled)  # engines of one model (other test files too) share a table
    sampled = SamplingParams(temperature=0.7, top_p=0.9, seed=1)
    first = engine.generate([Request(prompts[1], 3, sampled)])  # batch 1: shapes no other test here compiles
    new = {key: exe for key, exe in engine.runtime.table.compiled.items() if key not in before}
    assert first.timings.programs_compiled == 2 and sorted(key[0] for key in new) == ["init", "step"]
    # The cache and the logits are updated in place: the step's outputs alias its inputs (no cache copy).
    (step,) = [exe for key, exe in new.items() if key[0] == "step"]
    cache = jax.eval_shape(lambda: init_cache(engine.cfg, 1, MAX_CONTEXT, "float32"))
    donated = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)) + 4 * engine.vocab_size
    assert step.memory_analysis().alias_size_in_bytes >= donated
    calls = _count_calls(engine)
    steps = 9
    out, compiles = _backend_compiles(lambda: engine.generate(
        [Request(prompts[1][1:], steps, SamplingParams(temperature=1.3, top_k=5, seed=2))]))
    assert compiles == [] and out.timings.programs_compiled == 0
    prefill_calls = len(prompts[1]) - 1  # a 5-row prompt: a short segment, one call per row
    assert calls == ["init"] + ["step"] * (prefill_calls + steps - 1)
    assert out.timings.decode_steps == steps == len(out.generations[0].token_ids)

    seen = set(engine.runtime.table.compiled)
    greedy = engine.generate([Request(prompts[1], 3)])
    (argmax,) = [exe for key, exe in engine.runtime.table.compiled.items() if key not in seen]
    assert greedy.timings.programs_compiled == 1
    vocab_sorts = lambda exe: [line for line in exe.as_text().splitlines()
                               if " sort(" in line and f"[1,{engine.vocab_size}]" in line.split(" sort(")[0]]
    assert vocab_sorts(step) and not vocab_sorts(argmax)
    _, compiles = _backend_compiles(lambda: engine.generate([Request(prompts[1][2:], 4)]))
    assert compiles == []


def test_head_on_last_rows_and_chained_steps_keep_the_tokens(setup):
    """Greedy and seeded sampling, a ragged batch over a long and a short segment, a streamed and a queued
    decode loop: the same tokens as the recording path (head over every row), and the recorded decode logits
    equal the step's own (streamed) ones."""
    _, _, prompts = setup
    engine = make_engine(setup)
    requests = [Request(prompts[0], 7), Request(prompts[1], 5, SamplingParams(temperature=0.9, top_k=30, seed=4))]
    recorded = engine.generate(requests, record_logits=True)
    queued = engine.generate(requests)
    streamed_tokens = []
    streamed = engine.generate(requests, on_tokens=lambda step, tokens, alive: streamed_tokens.append(
        (step, tokens.copy(), alive.copy())))
    for out in (queued, streamed):
        assert [g.token_ids for g in out.generations] == [g.token_ids for g in recorded.generations]
        assert [g.finish_reason for g in out.generations] == ["length", "length"]
    assert [len(g.token_ids) for g in recorded.generations] == [7, 5]
    assert [s for s, _, _ in streamed_tokens] == list(range(7))
    assert [int(t[0]) for _, t, _ in streamed_tokens] == list(recorded.generations[0].token_ids)
    assert [bool(a[1]) for _, _, a in streamed_tokens] == [True] * 5 + [False] * 2
    # Greedy sequence 0: every token is the argmax of the distribution it was recorded with.
    assert list(np.argmax(recorded.decode_logits, axis=-1)) == list(recorded.generations[0].token_ids)
    np.testing.assert_allclose(recorded.decode_logits[0], recorded.prefill_logits[-1], atol=0)


def test_end_id_stops_a_queued_loop(setup):
    """An end id sampled while later steps are already queued: the queued steps change nothing (tokens and
    finish reasons as the streamed, one-step-ahead loop), and the next request starts clean."""
    _, _, prompts = setup
    engine = make_engine(setup)
    requests = [Request(prompts[0], 8), Request(prompts[1], 8)]
    free = engine.generate(requests).generations
    engine.eos_ids = (free[1].token_ids[1],)  # sequence 1 stops at its second token
    stopped = engine.generate(requests).generations
    streamed = engine.generate(requests, on_tokens=lambda *a: None).generations
    assert stopped == streamed
    assert stopped[1].token_ids == free[1].token_ids[:2] and stopped[1].finish_reason == "eos"
    engine.eos_ids = ()
    assert engine.generate(requests).generations == free


@pytest.mark.slow
def test_programs_do_not_grow_with_layers():
    """A ratio-2 full layer followed by a run of 2 or of 6 reuse layers (one scanned unit either way, docs/DESIGN.md
    "Scanned layers") compiles the same programs for a request. Compile seconds are printed, not bounded (wall
    time on a shared CI box); `tests/model/test_scan_layers.py` bounds the program's size."""
    counts, seconds = {}, {}
    for run in (2, 6):
        layers = 1 + run
        cfg = load_named("tiny").replace(
            num_hidden_layers=layers, compress_ratios=(2,) * layers, kv_source_layer_ids=(0,),
            index_source_layer_ids=(0,), candidate_source_layer_id=-1, num_nextn_predict_layers=0,
            dspark_target_layer_ids=(), engram_layer_ids=())
        assert len(cfg.layer_units()) == 2
        model = build_model(cfg, ModelOptions(dtype="float32", quant_rounding=False), make_tiny.random_weights(cfg, 0))
        engine = Engine(model, cfg, max_context=MAX_CONTEXT, cache_dtype="float32", eos_ids=())
        seconds[run] = engine.precompile(1, 4)
        counts[run] = sorted(key[0] for key in engine.runtime.table.compiled)
    print(f"compile seconds: 3 layers {seconds[2]:.1f}, 7 layers {seconds[6]:.1f}")
    assert counts[2] == counts[6] == ["init", "step"]


@pytest.mark.slow  # --decode-chunk: test_generate_cli checks its tokens from the CLI
def test_decode_chunks_give_the_step_loops_tokens(setup):
    """``decode_chunk = k``: k decode steps per program call (one ``lax.scan`` of the step) give exactly the tokens,
    finish reasons and streamed (step, token, alive) triples of one call per token — for a k that divides the
    token count and one that does not, a ragged batch (7 and 5 new tokens), seeded sampling, and an end id drawn
    mid-chunk (the chunk's later steps then write nothing: the next request is unchanged). Decode calls: one per
    chunk."""
    cfg, model, prompts = setup
    requests = [Request(prompts[0], 7), Request(prompts[1], 5, SamplingParams(temperature=0.9, top_k=30, seed=4))]

    def run(engine, reqs):
        seen = []
        out = engine.generate(reqs, on_tokens=lambda step, tokens, alive: seen.append(
            (step, tuple(int(t) for t in tokens), tuple(bool(a) for a in alive))))
        return [(g.token_ids, g.finish_reason) for g in out.generations], seen, engine.generate(reqs).generations

    one = make_engine(setup)
    expected = run(one, requests)
    for k in (3, 7):
        chunked = Engine(model, cfg, max_context=MAX_CONTEXT, cache_dtype="float32", eos_ids=(),
                         segment_plan=lambda n: fixed_segments(n, 16), short_rows=8, decode_chunk=k)
        got = run(chunked, requests)
        assert got[0] == expected[0] and got[1] == expected[1] and got[2] == expected[2]
    free = expected[2]
    stop_at = free[1].token_ids[1]
    for engine in (one, chunked):  # sequence 1 stops at its second token, inside the first chunk
        engine.eos_ids = (stop_at,)
    stopped = chunked.generate(requests).generations
    assert stopped == one.generate(requests).generations
    assert stopped[1].token_ids == free[1].token_ids[:2] and stopped[1].finish_reason == "eos"
    calls = _count_calls(chunked)
    chunked.eos_ids = ()
    assert chunked.generate(requests).generations == free
    assert calls.count("steps") == 1  # 7 tokens: token 0 from the prefill, then one 7-step chunk


def test_decode_chunk_must_be_positive(setup):
    cfg, model, _ = setup
    with pytest.raises(ValueError, match="decode_chunk"):
        Engine(model, cfg, max_context=MAX_CONTEXT, decode_chunk=0)
