"""The slot engine in-process, against `Engine.generate` of each request alone (the reference: tests/test_engine.py
checks it against one plain forward).

Model: tests/test_engine.py's 5-layer cut of the tiny config (every layer role), float32, rounding points off.
16-row segments and ``short_rows`` 8: prompts of at most 8 tokens feed row by row in the decode steps, longer
ones prefill into a one-row cache (bucket 16) and are copied into their slot — both paths run here, mixed, with
greedy and seeded sampling; sampled tokens must be equal too, which holds only if each slot draws from its own
key with its own step count, whichever step variant (with the sampling arrays, or argmax-only while every slot is
greedy) runs.
"""

from __future__ import annotations

import asyncio
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_events import backend_compiles, branching_programs
from test_engine import mini_config

from dsv41_jax import make_tiny
from dsv41_jax.engine import Engine, Request, fixed_segments
from dsv41_jax.loading import build_model
from dsv41_jax.model.transformer import ModelOptions
from dsv41_jax.sampling import SamplingParams, sample, sampling_arrays
from dsv41_jax.serve.slots import Job, SlotEngine
from dsv41_jax.serve.worker import QueueFull, Worker

SLOTS = 3


@pytest.fixture(scope="module")
def engine():
    """The engine, with the programs of a SLOTS-slot engine and of the reference (``Engine.generate`` of one
    request) compiled: every test here reuses them (the program table is per model), so the module compiles
    each program once."""
    cfg = mini_config()
    model = build_model(cfg, ModelOptions(dtype="float32", quant_rounding=False), make_tiny.random_weights(cfg, 0))
    engine = Engine(model, cfg, max_context=64, cache_dtype="float32", eos_ids=(),
                    segment_plan=lambda n: fixed_segments(n, 16), short_rows=8)
    SlotEngine(engine, SLOTS).precompile()
    engine.precompile(1, 40)
    engine.precompile(1, 40, greedy=True)  # the reference's greedy requests step with the argmax only
    return engine


def _requests():
    rng = np.random.default_rng(0)
    # 16: one long segment (a 12 would run in a 12-row program alone, a compile of its own)
    shapes = [(5, 7), (30, 4), (17, 9), (3, 11), (40, 5), (8, 3), (16, 6)]
    return [Request(tuple(int(x) for x in rng.integers(3, 512, n)), m,
                    SamplingParams() if i % 2 == 0 else SamplingParams(temperature=1.0, top_k=40, seed=i))
            for i, (n, m) in enumerate(shapes)]


def test_sample_with_per_sequence_steps_equals_one_by_one():
    logits = np.random.default_rng(1).normal(size=(3, 64)).astype(np.float32)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (4, 5, 6)]
    steps = np.array([0, 3, 7], np.int32)
    together = np.asarray(jax.jit(sample)(logits, sampling_arrays(params), steps))
    alone = [int(jax.jit(sample)(logits[b:b + 1], sampling_arrays([params[b]]), jnp.int32(steps[b]))[0])
             for b in range(3)]
    assert together.tolist() == alone


def test_slots_equal_alone_reuse_slots_and_compile_nothing(engine):
    slots = SlotEngine(engine, SLOTS)
    slots.precompile()
    requests = _requests()
    got: dict[int, list] = {}
    done: dict[int, str] = {}

    def sink(i):
        def put(kind, value):
            if kind == "token":
                got.setdefault(i, []).append(value)
            else:
                done[i] = value
        return put

    with backend_compiles() as compiles:
        # Staggered arrival: two now, the rest one per step; 7 requests through 3 slots.
        for i in (0, 1):
            slots.add(Job(i, requests[i], sink(i)))
        pending = list(range(2, len(requests)))
        while slots.busy or pending:
            if pending:
                i = pending.pop(0)
                slots.add(Job(i, requests[i], sink(i)))
            slots.step()
    assert compiles == []
    assert 0 < slots.greedy_steps < slots.decode_steps  # both step variants ran, switching as slots changed
    assert branching_programs(engine) == []  # no program branches on device values
    assert slots.prefill_calls == 2 + 2 + 3 + 1  # the 17-, 30-, 40- and 16-token prompts, 16-row segments
    for i, r in enumerate(requests):
        alone = engine.generate([r]).generations[0]
        assert tuple(got[i]) == alone.token_ids and done[i] == "length", i


def test_cancel_frees_the_slot_at_once(engine):
    """Three running requests fill the slots; a cancel frees one at once for the waiting fourth, whose tokens
    (in the slot the cancelled request left mid-stream) are those it gets alone."""
    slots = SlotEngine(engine, SLOTS)
    events = []

    def sink(i):
        return lambda kind, value: events.append((i, kind, value))

    for i in range(SLOTS):
        slots.add(Job(i, Request((5 + i, 6, 7), 50), sink(i)))
    slots.add(Job(SLOTS, Request((8, 9), 4), sink(SLOTS)))
    for _ in range(6):
        slots.step()
    slots.cancel(0)
    slots.step()  # request 0 leaves, the waiting one takes its slot in the same step
    assert (0, "done", "cancelled") in events and slots.running[0].id == SLOTS
    # 3 steps feed the prompt rows (the last one draws token 0), 3 more draw; the host reads a step behind.
    assert sum(1 for e in events if e[:2] == (0, "token")) == 6 - 3
    for i in range(1, SLOTS):
        slots.cancel(i)
    while slots.busy:
        slots.step()
    mine = [e for e in events if e[0] == SLOTS]
    assert mine[-1] == (SLOTS, "done", "length")
    assert tuple(v for _, kind, v in mine if kind == "token") == \
        engine.generate([Request((8, 9), 4)]).generations[0].token_ids


def test_a_failing_step_fails_its_request_and_the_engine_thread_goes_on(engine, monkeypatch):
    """The engine thread (serve.worker): a step that raises fails the requests it held (the server's 500) and
    the next request runs; every slot taken and no queue: one more request in flight is refused at once (the
    503)."""
    real, failures = SlotEngine._decode_step, []

    def flaky(self):
        if not failures:
            failures.append(1)
            raise RuntimeError("injected")
        return real(self)

    monkeypatch.setattr(SlotEngine, "_decode_step", flaky)
    worker = Worker(SlotEngine(engine, SLOTS), max_queue=0)

    async def run():
        loop = asyncio.get_running_loop()
        held = [worker.submit(Request((5, 6), 3), loop)[1] for _ in range(SLOTS)]
        with pytest.raises(QueueFull):
            worker.submit(Request((5,), 2), loop)
        worker.start()  # after the submits: its first step holds all of them
        failed = [await asyncio.wait_for(events.get(), 120) for events in held]
        _, second = worker.submit(Request((5, 6), 3), loop)
        return failed, [await asyncio.wait_for(second.get(), 120) for _ in range(4)]

    try:
        failed, events = asyncio.run(run())
    finally:
        worker.stop()
    assert [kind for kind, _ in failed] == ["error"] * SLOTS
    assert [kind for kind, _ in events] == ["token", "token", "token", "done"] and events[-1] == ("done", "length")
    assert [v for _, v in events[:3]] == list(engine.generate([Request((5, 6), 3)]).generations[0].token_ids)


def test_a_long_prompt_stalls_a_running_stream_at_most_one_segment(engine):
    """A stream decodes while a 60-token prompt (4 segments of 16 rows) prefills beside it: between two of the
    stream's tokens at most one prefill segment runs (the scheduler interleaves segments with decode steps), so
    the stream's longest gap is about one decode step plus one segment, not the whole prefill. The structural
    check is exact; the clock's is loose (2x plus 50 ms over a decode step and a segment measured alone, the
    segment as a quarter of the prefill alone: dispatch is asynchronous, so single calls cannot be timed), for a
    2-core machine shared with other work."""
    rng = np.random.default_rng(7)
    long_prompt = Request(tuple(int(t) for t in rng.integers(3, 512, 60)), 2)
    stream = Request((5, 6, 7), 50)

    def run(with_stream: bool, with_long: bool):
        slots = SlotEngine(engine, SLOTS)
        tokens, segments_before = [], []

        def sink(kind, value):
            if kind == "token":
                tokens.append(time.perf_counter())
                segments_before.append(slots.prefill_calls)

        if with_stream:
            slots.add(Job(0, stream, sink))
            for _ in range(8):  # its prompt fed and a few tokens: decoding alone
                slots.step()
        if with_long:
            slots.add(Job(1, long_prompt, lambda kind, value: None))
        t0 = time.perf_counter()
        while slots.prefill_calls < 4 * with_long or (with_stream and len(tokens) < 20):
            slots.step()
        for job in range(2):
            slots.cancel(job)
        while slots.busy:
            slots.step()
        return np.diff(tokens), np.array(segments_before), time.perf_counter() - t0

    run(True, True)  # warm: every program has run once
    alone_gaps, _, _ = run(True, False)
    _, _, prefill_s = run(False, True)
    gaps, segments, _ = run(True, True)
    assert segments[-1] - segments[0] >= 3  # the prefill ran while the stream decoded
    assert np.diff(segments).max() <= 1  # at most one segment between two tokens
    bound = 2 * (np.median(alone_gaps) + prefill_s / 4) + 0.05
    assert gaps.max() <= bound, (gaps.max(), np.median(alone_gaps), prefill_s)


def test_penalties_count_each_slots_tokens_on_both_prefill_paths(engine):
    """A penalised sampled request beside others: prefilled apart (a 30-token prompt: 2 segments; its first
    token then drawn by a decode step, which has its counts) or row by row (``short_rows`` above it), the same
    tokens; the counts its slot was penalised with are those of its tokens, its prompt's ids marked; nothing
    compiles."""
    rng = np.random.default_rng(11)
    prompt = tuple(int(t) for t in rng.integers(3, 512, 30))
    mine = Request(prompt, 12, SamplingParams(temperature=0.8, seed=3, frequency_penalty=1.0, presence_penalty=0.5,
                                              repetition_penalty=1.3))
    others = [Request((7, 8, 9), 15, SamplingParams(temperature=1.0, seed=4)),
              Request((5,) * 20, 10, SamplingParams(presence_penalty=1.0))]

    def run(short_rows):
        slots = SlotEngine(engine, SLOTS, short_rows=short_rows)
        got: dict[int, list] = {0: [], 1: [], 2: []}
        for i, r in enumerate([others[0], mine, others[1]]):
            slots.add(Job(i, r, lambda kind, value, i=i: got[i].append(value) if kind == "token" else None))
        slot = None
        while slots.busy:
            slots.step()
            slot = next((b for b, j in enumerate(slots.running) if j is not None and j.id == 1), slot)
        return got, slots, slot

    with backend_compiles() as compiles:
        apart, slots, slot = run(None)
        row_by_row, _, _ = run(64)
    assert compiles == []
    counts, seen = slots.penalty_state(slot)
    assert apart == row_by_row and len(apart[1]) == 12
    np.testing.assert_array_equal(counts, np.bincount(apart[1], minlength=512))
    np.testing.assert_array_equal(np.flatnonzero(seen), sorted(set(prompt)))


def test_a_budget_above_the_segment_runs_several_segments_a_step(engine):
    """``prefill_budget`` 48 over 16-row segments: a 40-token prompt's three segments (16, 16, and 8 in the 16-row
    program) run in one step, a 30-token prompt behind it waits for the next; the tokens are those of the default
    budget (one segment a step) and of each request alone; nothing compiles."""
    rng = np.random.default_rng(5)
    requests = [Request(tuple(int(t) for t in rng.integers(3, 512, n)), 4) for n in (40, 30)]

    def run(budget):
        slots = SlotEngine(engine, SLOTS, prefill_budget=budget)
        got: dict[int, list] = {0: [], 1: []}
        for i, r in enumerate(requests):
            slots.add(Job(i, r, lambda kind, value, i=i: got[i].append(value) if kind == "token" else None))
        while slots.busy:
            slots.step()
        return got, slots

    with backend_compiles() as compiles:
        wide, slots = run(48)
        narrow, _ = run(None)
    assert compiles == []
    assert list(slots.prefill_per_step)[:2] == [48, 32] and slots.prefill_calls == 5
    assert wide == narrow
    for i, r in enumerate(requests):
        assert tuple(wide[i]) == engine.generate([r]).generations[0].token_ids, i
