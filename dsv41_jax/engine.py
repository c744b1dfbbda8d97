"""The batch driver: prefill a batch of prompts in segments, then decode, on a model's `Runtime` (static shapes,
each program compiled once per shape; the programs and their arguments are `dsv41_jax.runtime`'s).

Prefill cuts the batch's longest prompt into the planner's segments ``[start, start + n)``; sequence b
contributes ``clip(len_b - start, 0, n)`` real rows. A segment of more than ``short_rows`` rows runs as one
``step`` call whose T is n rounded up to a power-of-two bucket (so a handful of programs serve every prompt
length); a *short* segment (PLANNER.md §A: ≤ 16 rows) runs row by row through ``step[B, 1]`` — the decode
program — which saves a compile for short prompts. The prompt's last call draws the first new token. Decode is
one ``step[B, 1]`` call per token with ``lengths = keep_going`` (or one ``steps`` call per ``decode_chunk``
tokens), so finished sequences' caches stay untouched; the host dispatches step n+1 before it reads step n's
tokens (printing lags a step), and without a streaming callback keeps ``DECODE_AHEAD`` steps queued, so it waits
on the device only to read tokens that are long done. Steps queued past the last stop write nothing (lengths 0)
and are dropped. A batch of greedy requests runs the argmax-only step (no sampling arrays); any other sampling
settings share one program. A batch with images encodes them once (one tower call) and every step call of it
takes its slice of the image rows, so spans may cross segment boundaries.

Engram (`MODEL.md` §B.12): for a model with engram layers every ``step`` call also takes the call's table
rows, hashed on the host just before the call (`Runtime.engram_rows`) from the call's ids and each sequence's
last three ids. That history lives here, per ``generate`` call (numpy ``[B, 3]``), not in the device cache: the
ids of every segment and every sampled token pass through the host (an engram model's decode reads each step's
tokens before it dispatches the next), the hash needs the host, and the device program stays free of host-only
state; segments and decode steps then hash exactly as one pass (tests/test_engram_parity.py).
"""

from __future__ import annotations

import collections
import functools
import math
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import jax
import numpy as np

from .config import ModelConfig
from .planner import SHORT_ROWS, segment_sizes
from .runtime import (
    Call,
    EngineInputError,
    FlatState,
    ModelLike,
    Runtime,
    StepOut,
    keeps_going,
    segment_images,
    stop_ids,
)
from .sampling import SamplingParams

__all__ = ["DECODE_AHEAD", "Engine", "EngineInputError", "GenerateResult", "Generation", "ProgressCallback", "Request",
           "SegmentPlan", "StepTiming", "Timings", "TokenCallback", "all_greedy", "bucket_rows", "check_requests",
           "fixed_segments", "planned_segments"]

DECODE_AHEAD = 4  # decode steps queued on the device while the host reads a token (no streaming callback)


@dataclass(frozen=True)
class Request:
    """One prompt to continue. ``max_new_tokens`` >= 1. ``images``: a prompt with image spans
    (`vision.preprocess.ImagePrompt`); then ``prompt_ids`` are its expanded ids (``images.ids``)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 16
    sampling: SamplingParams = SamplingParams()
    images: object | None = None  # vision.preprocess.ImagePrompt (kept untyped: `import engine` stays light)


@dataclass(frozen=True)
class Generation:
    """What one request produced. finish_reason: 'eos' (an end id was sampled; it is the last token) or
    'length'."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str


@dataclass
class Timings:
    """Wall seconds; compiling is kept apart from running."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    compile_s: float = 0.0
    programs_compiled: int = 0
    programs_loaded: int = 0  # of those, executables found in the persistent cache (`compiler`)
    segments: tuple[int, ...] = ()

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tok_s(self) -> float:
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else float("nan")


@dataclass
class GenerateResult:
    """Generations in request order. With ``record_logits`` (first request only, f32): ``prefill_logits``
    [prompt_len, V], one row per prompt position, and ``decode_logits`` [steps, V], where ``decode_logits[i]`` is
    the distribution ``token_ids[i]`` was drawn from (so ``decode_logits[0]`` is the last prompt row's)."""

    generations: list[Generation]
    timings: Timings
    prefill_logits: np.ndarray | None = None
    decode_logits: np.ndarray | None = None


TokenCallback = Callable[[int, np.ndarray, np.ndarray], None]  # (step, tokens [B], emitted [B] bool)
ProgressCallback = Callable[[int, int], None]  # (prompt rows done, total rows)
SegmentPlan = Callable[[int], Sequence[int]]  # longest prompt length -> segment sizes (sum = that length)


def planned_segments(cfg: ModelConfig, world: int) -> SegmentPlan:
    """The planner's segment sizes at ``world`` (`planner.segment_sizes`, PLANNER.md §A): the engine's default."""
    return functools.partial(segment_sizes, cfg, world)


def fixed_segments(prompt_len: int, rows: int) -> list[int]:
    """``rows``-row segments and a shorter tail: 5000 -> [2048, 2048, 904]."""
    full, tail = divmod(prompt_len, rows)
    return [rows] * full + ([tail] if tail else [])


def bucket_rows(rows: int, cap: int) -> int:
    """The program size serving a multi-row segment: the next power of two >= rows, at most ``cap``
    (never below ``rows``)."""
    return max(rows, min(cap, 1 << math.ceil(math.log2(max(rows, 1)))))


def check_requests(requests: Sequence[Request], vocab_size: int, max_context: int) -> None:
    """Raise EngineInputError for a request a model of ``vocab_size`` ids and this context cannot run."""
    if not requests:
        raise EngineInputError("no prompts given")
    for i, r in enumerate(requests):
        which = f"prompt {i + 1}" if len(requests) > 1 else "the prompt"
        if not r.prompt_ids:
            raise EngineInputError(f"{which} is empty")
        bad = [t for t in r.prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise EngineInputError(f"{which} has ids outside the model's vocabulary 0..{vocab_size - 1}: "
                                   f"{', '.join(map(str, bad[:5]))}{' ...' if len(bad) > 5 else ''}")
        if len(r.prompt_ids) > max_context:
            raise EngineInputError(f"{which} has {len(r.prompt_ids)} tokens, longer than the context of "
                                   f"{max_context} tokens")
        if r.max_new_tokens < 1:
            raise EngineInputError(f"max new tokens must be at least 1, got {r.max_new_tokens}")
        # The last sampled token is never fed back, so it needs no cache row.
        if len(r.prompt_ids) + r.max_new_tokens - 1 > max_context:
            raise EngineInputError(f"{which} ({len(r.prompt_ids)} tokens) plus {r.max_new_tokens} new tokens "
                                   f"does not fit the context of {max_context} tokens")
        r.sampling.validate()
        if r.images is not None and tuple(r.images.ids) != tuple(r.prompt_ids):
            raise EngineInputError(f"{which}: its prompt ids are not the expanded ids of its image prompt")


def all_greedy(requests) -> bool:
    """Whether every request is greedy: such a batch runs the argmax-only step programs (`Engine.stop_inputs`)."""
    return all(r.sampling.greedy for r in requests)


class StepTiming(NamedTuple):
    """``Engine.step_seconds``: seconds per step, the cache after the steps, the compiled step program."""

    seconds: float
    cache: object
    program: object


class Engine:
    """Runs batches of requests through one model. ``max_context``: cache capacity per sequence (positions).

    ``segment_plan(longest prompt) -> sizes`` (default: the planner's, ``planned_segments``); segments of at most
    ``short_rows`` rows run row by row through the decode program (0: never). ``hasher``: the engram hasher
    (`dsv41_jax.engram.Hasher`, e.g. with a checkpoint's token map) when the model runs engram layers; default
    ``Hasher(cfg)``. ``host_tables``: `dsv41_jax.engram.HostTables` for a model built with
    ``ModelOptions(engram_tables="host")``: each call's rows are gathered on the host and sent with it.
    ``decode_chunk``: decode steps per program call (1: one ``step[B, 1]`` call per token); engram models and
    recorded runs decode one step at a time whatever it says. ``runtime``: the model's `Runtime` (its programs,
    placement and step inputs), built here; a copy of an engine shares it.
    """

    def __init__(self, model: ModelLike, cfg: ModelConfig, *, max_context: int, cache_dtype: str = "bfloat16",
                 eos_ids: Sequence[int] | None = None, segment_plan: SegmentPlan | None = None,
                 short_rows: int = SHORT_ROWS, init_cache: Callable | None = None, mesh=None,
                 hasher=None, host_tables=None, decode_chunk: int = 1):
        if decode_chunk < 1:
            raise ValueError(f"decode_chunk must be at least 1, got {decode_chunk}")
        self.cfg = cfg
        self.max_context = int(max_context)
        self.eos_ids = tuple(eos_ids if eos_ids is not None else cfg.eos_token_ids)
        self.segment_plan = segment_plan or planned_segments(cfg, 1 if mesh is None else mesh.size)
        self.short_rows = short_rows
        self.decode_chunk = int(decode_chunk)
        self.runtime = Runtime(model, cfg, cache_dtype=cache_dtype, init_cache=init_cache, mesh=mesh,
                               hasher=hasher, host_tables=host_tables)

    @property
    def vocab_size(self) -> int:
        return self.runtime.vocab_size

    @property
    def cache_dtype(self) -> str:
        return self.runtime.cache_dtype

    @property
    def hasher(self):
        """The engram hasher (`dsv41_jax.engram.Hasher`), or None for a model without engram layers."""
        return self.runtime.hasher

    @property
    def host_tables(self):
        return self.runtime.host_tables

    @property
    def state(self) -> FlatState:
        """The model's state, every model program's first argument."""
        return self.runtime.state

    def check(self, requests: Sequence[Request]) -> None:
        """Raise EngineInputError for a request the engine cannot run."""
        check_requests(requests, self.vocab_size, self.max_context)

    def stop_ids(self) -> np.ndarray:
        """The end ids as the step program and the host loops take them: int32 [E], (-1,) when there are none
        (no token is −1)."""
        return stop_ids(self.eos_ids)

    def stop_inputs(self, requests: Sequence[Request], greedy: bool = False) -> tuple:
        """The step's per-request constants on the device, once per batch: (end ids [E], max new tokens [B],
        SamplingArrays, or None when ``greedy`` (the caller's ``all_greedy(requests)``: the argmax-only step))."""
        return self.runtime.stop_inputs(self.eos_ids, [r.max_new_tokens for r in requests],
                                        None if greedy else [r.sampling for r in requests])

    def plan_segments(self, requests: Sequence[Request]) -> tuple[list[int], list[int]]:
        """(segment sizes of the longest prompt, program rows per segment: 1 for short segments, else the
        bucket)."""
        total = max(len(r.prompt_ids) for r in requests)
        sizes = [int(n) for n in self.segment_plan(total)]
        if sum(sizes) != total or min(sizes) < 1:
            raise EngineInputError(f"segment plan {sizes} does not cover the {total}-token prompt")
        cap = max(sizes)
        rows = [1 if n <= self.short_rows else bucket_rows(n, cap) for n in sizes]
        return sizes, rows

    # ------------------------------------------------------------------------------------------ compiling
    @property
    def compile_count(self) -> int:
        """Programs compiled so far by this engine's runtime (one per program, static arguments and input
        shapes)."""
        return self.runtime.compile_count

    @property
    def programs_loaded(self) -> int:
        """Of ``compile_count``, the programs loaded whole from the persistent cache (no trace, no compile)."""
        return self.runtime.programs_loaded

    def _needs(self, batch: int, program_rows: Sequence[int], record: bool, images: bool = False,
               greedy: bool = False) -> list[Call]:
        """Everything a batch of ``batch`` with these prefill program sizes runs (``images``: the forward
        programs take image rows, whose shapes are known after encoding: they compile on first use)."""
        rt, eos = self.runtime, len(self.stop_ids())
        specs = [rt.init_call(batch, self.max_context)]
        for t in sorted({1, *program_rows}) if not images else ():
            specs.append(rt.step_call(batch, t, self.max_context, eos, record=record, greedy=greedy))
        if self.decode_chunk > 1 and rt.hasher is None and not record and not images:
            specs.append(rt.steps_call(batch, self.decode_chunk, self.max_context, eos, greedy=greedy))
        return specs

    def precompile(self, batch: int, prompt_len: int, record_logits: bool = False, images: bool = False,
                   greedy: bool = False) -> float:
        """Compile what a batch of ``batch`` prompts of up to ``prompt_len`` tokens needs; returns seconds.
        ``images``: the prompts have images, whose prefill programs compile on first use (decode only here);
        ``greedy``: every request will be greedy (its steps are programs of their own, `stop_inputs`)."""
        _, rows = self.plan_segments([Request((0,) * prompt_len)])
        return self.runtime.compile(self._needs(batch, rows, record_logits, images, greedy=greedy))

    # ------------------------------------------------------------------------------------------ running
    def generate(self, requests: Sequence[Request], *, on_tokens: TokenCallback | None = None,
                 on_prefill: ProgressCallback | None = None, record_logits: bool = False) -> GenerateResult:
        """Prefill every request's prompt, then decode until each hits an end id or its max new tokens."""
        self.check(requests)
        rt = self.runtime
        sizes, rows = self.plan_segments(requests)
        timings = Timings(prompt_tokens=sum(len(r.prompt_ids) for r in requests), segments=tuple(sizes))
        compile_before, count_before, loaded_before = rt.compile_s, self.compile_count, self.programs_loaded
        has_images = any(r.images is not None for r in requests)
        greedy = all_greedy(requests)
        rt.compile(self._needs(len(requests), rows, record_logits, has_images, greedy=greedy))
        cache = rt.init_cache(len(requests), self.max_context)
        images = rt.encode_images([r.images for r in requests], max(len(r.prompt_ids) for r in requests))
        stop = self.stop_inputs(requests, greedy=greedy)
        out, prefill_logits, history = self._prefill(requests, cache, stop, sizes, rows, timings, on_prefill,
                                                     record_logits, images)
        step_images = segment_images(images, 0, 0, 1)
        if step_images is not None:  # the same every decode step: placed once
            step_images = rt.place(step_images)
        first_row = prefill_logits[-1:] if record_logits else None  # token 0's distribution
        generations, decode_logits = self._decode(requests, out, first_row, stop, timings, on_tokens,
                                                  record_logits, history, step_images)
        timings.compile_s = rt.compile_s - compile_before
        timings.programs_compiled = self.compile_count - count_before
        timings.programs_loaded = self.programs_loaded - loaded_before
        return GenerateResult(generations, timings, prefill_logits, decode_logits)

    def decode_from(self, cache, last_ids, requests: Sequence[Request], *,
                    on_tokens: TokenCallback | None = None) -> GenerateResult:
        """Decode from a cache that already holds every prompt but its last token (``cache.offset [B]`` rows),
        feeding ``last_ids [B]`` first: what ``generate`` does after its prefill, timed as decode (every one of
        the tokens is a one-row step). For benchmarks at long positions (a random cache from
        ``profiling.build.build_cache``); the cache (shaped for this engine's ``max_context``) is donated. Models
        without engram layers (their hash history would start from the prompt)."""
        if self.hasher is not None:
            raise EngineInputError("decode_from needs a model without engram layers")
        batch = len(requests)
        stop = self.stop_inputs(requests, greedy=all_greedy(requests))
        timings = Timings()
        compiled_before, t0 = self.runtime.compile_s, time.perf_counter()  # first-use compiles: not decode time
        args, _ = self.runtime.step_args(cache, np.zeros((batch, self.vocab_size), np.float32),
                                         np.asarray(last_ids, np.int32).reshape(batch, 1), np.ones(batch, np.int32),
                                         np.ones(batch, bool), np.int32(0), stop)
        out = self.runtime.run_step(args)
        generations, _ = self._decode(requests, out, None, stop, timings, on_tokens, False, None)
        timings.decode_s = time.perf_counter() - t0 - (self.runtime.compile_s - compiled_before)
        return GenerateResult(generations, timings)

    def step_seconds(self, cache, last_ids, steps: int, sampling: SamplingParams | None = None) -> StepTiming:
        """``steps`` calls of the one-row step program chained on the device (each feeding the previous step's
        tokens), nothing read back, one wait at the end, after one warm-up call: the device-bound rate that
        ``generate``'s host loop is measured against. ``cache`` is donated and must hold ``steps + 1`` more
        positions. ``sampling``: every sequence's settings (default greedy: the argmax-only step program)."""
        rt, batch = self.runtime, len(last_ids)
        requests = [Request((0,), steps + 2, sampling or SamplingParams())] * batch  # nobody stops by length
        stop = self.stop_inputs(requests, greedy=all_greedy(requests))
        args, _ = rt.step_args(cache, np.zeros((batch, self.vocab_size), np.float32),
                               np.asarray(last_ids, np.int32).reshape(batch, 1), np.ones(batch, np.int32),
                               np.ones(batch, bool), np.int32(0), stop)
        run = rt.step_program(args)
        out = run(*args)
        jax.block_until_ready(out.tokens)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = run(rt.state, out.cache, out.tokens, out.lengths, out.last_logits, out.keep_going,
                      out.next_step, *stop, None, None)
        jax.block_until_ready(out.tokens)
        return StepTiming((time.perf_counter() - t0) / steps, out.cache, run)

    def _prefill(self, requests, cache, stop, sizes, rows, timings: Timings, on_prefill, record, images=None):
        """Run the prompts' segments -> (the last call's StepOut, whose tokens are every sequence's first new
        token, prefill logits of request 0 [len, V] | None, engram history)."""
        rt, batch = self.runtime, len(requests)
        lengths = np.array([len(r.prompt_ids) for r in requests], np.int32)
        total = int(lengths.max())
        padded = np.zeros((batch, total), np.int32)
        for b, r in enumerate(requests):
            padded[b, : lengths[b]] = r.prompt_ids
        logits = np.zeros((batch, self.vocab_size), np.float32)
        first_rows = []
        start = 0
        history = rt.empty_history(batch)
        compiled_before, t0 = rt.compile_s, time.perf_counter()  # first-use compiles: not prefill time
        for size, t in zip(sizes, rows):
            # A short segment runs as `size` one-row calls; a long one as one call of `t >= size` rows.
            for sub_start, sub_size in [(start + i, 1) for i in range(size)] if t == 1 else [(start, size)]:
                ids = np.zeros((batch, t), np.int32)
                ids[:, :sub_size] = padded[:, sub_start : sub_start + sub_size]
                sub_lengths = np.clip(lengths - sub_start, 0, sub_size).astype(np.int32)
                out, history = rt.prefill(cache, logits, ids, sub_lengths, stop, history,
                                          segment_images(images, sub_start, sub_size, t), record=record)
                cache, logits = out.cache, out.last_logits
                if record:
                    first_rows.append(np.asarray(out.first)[: min(sub_size, max(0, int(lengths[0]) - sub_start))])
            start += size
            if on_prefill:
                jax.block_until_ready(out.last_logits)
                on_prefill(start, total)
        jax.block_until_ready(out.tokens)
        timings.prefill_s = time.perf_counter() - t0 - (self.runtime.compile_s - compiled_before)
        return out, (np.concatenate(first_rows, axis=0) if record else None), history

    def _decode(self, requests, out: StepOut, first_row, stop, timings: Timings, on_tokens, record, history,
                images=None):
        """Read token 0 from the prefill's last call, then run one ``step`` program per token (or one ``steps``
        program per ``decode_chunk`` tokens).

        Without engram layers the host chains each call on the previous call's device outputs and keeps up to
        ``ahead`` calls queued while it reads tokens: one call (printing lags a call) with a streaming callback,
        ``DECODE_AHEAD`` steps (two chunks) without. Steps queued past the last stop do no cache writes (their
        lengths are 0) and are dropped. Engram models hash each step's ids on the host first: one step at a
        time."""
        rt, batch = self.runtime, len(requests)
        longest = max(r.max_new_tokens for r in requests)
        chunk = self.decode_chunk if self.hasher is None and not record else 1
        if self.hasher is not None:
            ahead = 0
        else:  # calls kept queued: a chunk call already holds `chunk` tokens
            ahead = 1 if on_tokens else (DECODE_AHEAD if chunk == 1 else 2)
        pending = collections.deque([(out.tokens, first_row)])  # oldest first
        eos, max_new = self.stop_ids(), np.array([r.max_new_tokens for r in requests], np.int32)
        dispatched = 1  # token indices dispatched so far
        alive = np.ones(batch, bool)  # sequences producing the token read next
        produced: list[list[int]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        recorded = []
        step = 0
        run = None  # the compiled decode program, looked up once

        def dispatch(ids, lengths, running, index):
            nonlocal out, history, run, dispatched
            args, history = rt.step_args(out.cache, out.last_logits, ids, lengths, running, index, stop, history,
                                         images)
            if run is None:
                run = rt.step_program(args, record=record, chunk=chunk)
            result = run(*args)
            if chunk == 1:
                out = result
                pending.append((out.tokens, out.first))
            else:
                out = result.last
                pending.append((result.tokens, None))
            rt.fetch(pending[-1][0])  # the host reads it next: the copy starts when it is ready
            dispatched += chunk

        compiled_before, t0 = self.runtime.compile_s, time.perf_counter()  # first-use compiles: not decode time
        while pending:
            while ahead and len(pending) <= ahead and dispatched < longest:
                dispatch(out.tokens, out.lengths, out.keep_going, out.next_step)
            tokens, first = pending.popleft()
            tokens_np = rt.read(tokens).reshape(batch, -1)
            for j in range(tokens_np.shape[1]):
                if record and alive[0]:
                    recorded.append(np.asarray(first)[0])
                for b in np.flatnonzero(alive):
                    produced[b].append(int(tokens_np[b, j]))
                    if int(tokens_np[b, j]) in self.eos_ids:
                        finish[b] = "eos"
                if on_tokens:
                    on_tokens(step, tokens_np[:, j], alive.copy())
                alive = keeps_going(alive, tokens_np[:, j], eos, step, max_new)
                step += 1
                if not alive.any():
                    break
            if not alive.any():
                break
            if not ahead:  # engram: the next ids go through the host hash first
                dispatch(tokens_np[:, -1:], alive.astype(np.int32), alive, np.int32(step))
        timings.decode_s = time.perf_counter() - t0 - (self.runtime.compile_s - compiled_before)
        timings.decode_steps = step
        timings.generated_tokens = sum(len(p) for p in produced)
        generations = [Generation(tuple(r.prompt_ids), tuple(p), f) for r, p, f in zip(requests, produced, finish)]
        return generations, (np.stack(recorded) if record else None)


