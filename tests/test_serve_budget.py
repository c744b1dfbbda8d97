"""The slot engine's prefill token budget (``prefill_budget``, the server's ``--max-prefill-tokens``) on the tiny
model (configs/tiny.json: 10 layers, every layer role; random weights, float32, rounding points off).

A stream decodes while a 4,000-token prompt prefills beside it with a 256-row budget: every scheduling step runs
at most 256 prefill rows beside its decode step (exact: counted), so the stream's longest gap is about one decode
step plus one budget of prefill, not the whole prefill (the clock's check is loose: 2x plus 50 ms over a decode
step and a 256-row segment measured alone, the segment as the prefill alone over its segment count: dispatch is
asynchronous, so single calls cannot be timed; a 2-core machine shared with other work). Every request's tokens
equal its tokens alone (the cut depends on the prompt and the budget only). Budget left after one prompt's
segment serves the next prompt's.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from compile_events import backend_compiles

from dsv41_jax import make_tiny
from dsv41_jax.config import load_named
from dsv41_jax.engine import Engine, EngineInputError, Request
from dsv41_jax.loading import build_model
from dsv41_jax.model.transformer import ModelOptions
from dsv41_jax.serve.slots import Job, SlotEngine

BUDGET = 256
LONG = 4000
SHORT_ROWS = 127  # prompts of <= 127 tokens feed in the decode steps: two prefill buckets (128, 256) to compile


@pytest.fixture(scope="module")
def engine():
    cfg = load_named("tiny")
    model = build_model(cfg, ModelOptions(dtype="float32", quant_rounding=False), make_tiny.random_weights(cfg, 0))
    engine = Engine(model, cfg, max_context=LONG + 64, cache_dtype="float32", eos_ids=(), short_rows=SHORT_ROWS)
    slots = SlotEngine(engine, 2, prefill_budget=BUDGET)
    assert slots.chunk == BUDGET and slots._prefill_rows() == [128, 256]
    slots.precompile()
    return engine


def _drive(slots: SlotEngine, jobs: dict[int, Request], start_after: dict[int, int] | None = None):
    """Run ``jobs`` (id -> request; ``start_after``: id -> steps before it is added) to the end -> (tokens by id,
    (time, long-prefill program rows so far) at each token of job 0)."""
    start_after = start_after or {}
    got: dict[int, list] = {i: [] for i in jobs}
    marks = []
    rows = [0]

    def sink(i):
        def put(kind, value):
            if kind == "token":
                got[i].append(value)
                if i == 0:
                    marks.append((time.perf_counter(), rows[0]))
        return put

    step = 0
    while step == 0 or slots.busy or any(step <= k for k in start_after.values()):
        for i, r in jobs.items():
            if start_after.get(i, 0) == step:
                slots.add(Job(i, r, sink(i)))
        slots.step()
        rows[0] = sum(slots.prefill_per_step)
        step += 1
    return got, marks


def test_a_long_prompt_stalls_a_stream_at_most_one_budget(engine):
    rng = np.random.default_rng(3)
    long_prompt = Request(tuple(int(t) for t in rng.integers(3, 500, LONG)), 3)
    stream = Request((5, 6, 7), 40)
    n_segments = -(-LONG // BUDGET)

    def run(jobs, start_after=None):
        slots = SlotEngine(engine, 2, prefill_budget=BUDGET)
        t0 = time.perf_counter()
        got, marks = _drive(slots, jobs, start_after)
        return got, marks, time.perf_counter() - t0, slots

    with backend_compiles() as compiles:
        long_alone, _, prefill_s, _ = run({1: long_prompt})  # also the warm-up: every program runs once
        alone, alone_marks, _, _ = run({0: stream})
        got, marks, _, slots = run({0: stream, 1: long_prompt}, {1: 5})
    assert compiles == []
    assert got[0] == alone[0] and got[1] == long_alone[1]  # each request's tokens are its tokens alone
    assert slots.prefill_calls == n_segments and slots.prefill_rows == LONG
    assert max(slots.prefill_per_step) <= BUDGET
    times, rows = np.array(marks).T
    during = np.flatnonzero(np.diff(rows) > 0)  # the gaps in which a prefill segment ran
    assert len(during) >= n_segments - 1  # the prefill ran while the stream decoded
    assert np.diff(rows).max() <= BUDGET  # at most one budget of prefill rows between two tokens
    step_s = np.median(np.diff([t for t, _ in alone_marks]))
    bound = 2 * (step_s + prefill_s / n_segments) + 0.05
    gaps = np.diff(times)
    assert gaps.max() <= bound, (gaps.max(), step_s, prefill_s)
    assert gaps.max() < prefill_s / 3  # not the whole prefill (the 63 s stall)


def test_budget_left_after_one_prompt_serves_the_next(engine):
    """Three 128-token prompts (one segment each, in the 128-row program) through a 256-row budget: two segments
    a step, so the three prefill in 2 steps, not 3; each request's tokens are its tokens alone."""
    rng = np.random.default_rng(4)
    requests = {i: Request(tuple(int(t) for t in rng.integers(3, 500, 128)), 4) for i in range(3)}
    slots = SlotEngine(engine, 3, prefill_budget=BUDGET)
    got, _ = _drive(slots, requests)
    assert list(slots.prefill_per_step)[:2] == [BUDGET, 128] and slots.prefill_calls == 3
    for i, r in requests.items():
        alone, _ = _drive(SlotEngine(engine, 3, prefill_budget=BUDGET), {i: r})
        assert got[i] == alone[i], i


def test_a_budget_not_above_the_short_rows_is_refused(engine):
    with pytest.raises(EngineInputError, match="must be above the short-prompt rows"):
        SlotEngine(engine, 2, prefill_budget=SHORT_ROWS)
