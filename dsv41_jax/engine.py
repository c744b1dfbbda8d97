"""Prefill in segments, then decode: static shapes, each step compiled once per shape.

The model is split once (``nnx.split``) into a graph definition and a state pytree; the jitted steps take the
state as an argument and ``nnx.merge`` it inside, so weights are inputs, not constants baked into programs.
Programs are compiled ahead of time (``jit(...).lower(...).compile()``) and kept in a table keyed by their
input shapes: a shape seen before never compiles again, and compile seconds are measured apart from run time.

Prefill: the batch's prompts (ragged lengths) are cut into segments ``[start, start + T)`` over the longest
prompt; sequence b contributes ``lengths[b] = clip(len_b - start, 0, T)`` real rows, the rest are padding the
model ignores (DESIGN.md "Model API"). Each segment's row count is rounded up to a power-of-two bucket (at
least ``min_bucket``, at most the segment size) so a handful of programs serve every prompt length.

Decode: one program per batch size; each call samples the next token of every running sequence from the
previous logits, decides on device which sequences keep going (EOS, max new tokens) and feeds the new tokens
back with ``lengths = keep_going`` so finished sequences' caches stay untouched.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import ModelConfig
from .sampling import SamplingArrays, SamplingParams, sample, sampling_arrays

FALLBACK_SEGMENT_ROWS = 2048  # until the planner says otherwise (PLANNER.md §A "Segment")


class EngineInputError(ValueError):
    """A request the engine cannot run (empty prompt, too long, ids outside the vocabulary, ...)."""


@dataclass(frozen=True)
class Request:
    """One prompt to continue. ``max_new_tokens`` >= 1."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 16
    sampling: SamplingParams = SamplingParams()


@dataclass(frozen=True)
class Generation:
    """What one request produced. finish_reason: 'eos' (an end id was sampled; it is the last token) or
    'length'."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str


@dataclass
class Timings:
    """Wall seconds, compile kept apart from running."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    compile_s: float = 0.0
    programs_compiled: int = 0
    segments: tuple[int, ...] = ()

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tok_s(self) -> float:
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else float("nan")


@dataclass
class GenerateResult:
    """Generations in request order; ``prefill_logits`` [prompt_len, V] and ``decode_logits`` [steps, V]
    (f32, first request only, when asked): ``decode_logits[i]`` is the distribution ``token_ids[i]`` was drawn
    from, so ``decode_logits[0]`` is the last prompt row's logits."""

    generations: list[Generation]
    timings: Timings
    prefill_logits: np.ndarray | None = None
    decode_logits: np.ndarray | None = None


TokenCallback = Callable[[int, np.ndarray, np.ndarray], None]  # (step, tokens [B], emitted [B] bool)
ProgressCallback = Callable[[int, int], None]  # (prompt rows done, total rows)
SegmentPlan = Callable[[int], Sequence[int]]  # longest prompt length -> segment sizes (sum = that length)


def fixed_segments(prompt_len: int, rows: int = FALLBACK_SEGMENT_ROWS) -> list[int]:
    """``rows``-row segments and a shorter tail: 5000 -> [2048, 2048, 904]."""
    full, tail = divmod(prompt_len, rows)
    return [rows] * full + ([tail] if tail else [])


def bucket_rows(rows: int, cap: int, min_bucket: int = 16) -> int:
    """The program size serving a segment of ``rows``: next power of two >= max(rows, min_bucket), <= cap."""
    return max(rows, min(cap, 1 << max(math.ceil(math.log2(max(rows, 1))), int(math.log2(min_bucket)))))


# ------------------------------------------------------------------------------------------- jitted steps
def _prefill_step(graphdef, state, cache, ids, lengths, last_logits, keep_first_row: bool):
    """ids [B,T] i32, lengths [B] i32, last_logits [B,V] f32 -> (cache, last_logits, first [T,V] | None).

    ``last_logits[b]`` is replaced by the logits of row ``lengths[b] - 1`` wherever ``lengths[b] > 0``: after the
    last segment it holds each prompt's final-row logits.
    """
    model = nnx.merge(graphdef, state)
    logits, cache = model(ids, cache, lengths=lengths)
    logits = logits.astype(jnp.float32)
    last_row = jnp.clip(lengths - 1, 0, ids.shape[1] - 1)
    row_logits = jnp.take_along_axis(logits, last_row[:, None, None], axis=1)[:, 0]
    last_logits = jnp.where((lengths > 0)[:, None], row_logits, last_logits)
    return cache, last_logits, (logits[0] if keep_first_row else None)


def _decode_step(graphdef, state, cache, logits, running, eos_ids, max_new, sampling: SamplingArrays, step):
    """Sample from logits [B,V], feed the tokens back; running [B] bool, eos_ids [E] i32, max_new [B] i32,
    step: i32 scalar (tokens already produced). -> (cache, tokens [B], next logits [B,V], keep_going [B])."""
    tokens = sample(logits, sampling, step)
    is_eos = jnp.any(tokens[:, None] == eos_ids[None, :], axis=-1)
    keep_going = running & ~is_eos & (step + 1 < max_new)
    model = nnx.merge(graphdef, state)
    next_logits, cache = model(tokens[:, None], cache, lengths=keep_going.astype(jnp.int32))
    return cache, tokens, next_logits[:, 0].astype(jnp.float32), keep_going


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


@dataclass
class _Programs:
    """Compiled executables keyed by (step name, static flags, input shapes); counts compile time."""

    graphdef: object
    compiled: dict = field(default_factory=dict)
    compile_s: float = 0.0

    def run(self, name: str, fn, static: dict, args: tuple, donate: tuple[int, ...]):
        key = (name, tuple(sorted(static.items())), _signature(args[1:]))  # args[0] (the state) never changes
        exe = self.compiled.get(key)
        if exe is None:
            start = time.perf_counter()
            jitted = jax.jit(fn, static_argnums=(0,), static_argnames=tuple(static), donate_argnums=donate)
            exe = jitted.lower(self.graphdef, *args, **static).compile()
            self.compile_s += time.perf_counter() - start
            self.compiled[key] = exe
        return exe(*args)


class Engine:
    """Runs requests through one model. ``max_context``: cache capacity per sequence (positions)."""

    def __init__(self, model: nnx.Module, cfg: ModelConfig, *, max_context: int, cache_dtype: str = "bfloat16",
                 eos_ids: Sequence[int] | None = None, segment_plan: SegmentPlan | None = None,
                 min_bucket: int = 16, mesh=None):
        from .model.cache import init_cache  # noqa: PLC0415 - keeps `import engine` light

        self.cfg = cfg
        self.max_context = int(max_context)
        self.cache_dtype = cache_dtype
        self.eos_ids = tuple(eos_ids if eos_ids is not None else cfg.eos_token_ids)
        self.segment_plan = segment_plan or fixed_segments
        self.min_bucket = min_bucket
        self.mesh = mesh
        self._init_cache = init_cache
        graphdef, self.state = nnx.split(model)
        self._programs = _Programs(graphdef=graphdef)

    # ------------------------------------------------------------------------------------------ checks
    def check(self, requests: Sequence[Request]) -> None:
        """Raise EngineInputError for a request the engine cannot run."""
        if not requests:
            raise EngineInputError("no prompts given")
        vocab = self.cfg.vocab_size
        for i, r in enumerate(requests):
            which = f"prompt {i + 1}" if len(requests) > 1 else "the prompt"
            if not r.prompt_ids:
                raise EngineInputError(f"{which} is empty")
            bad = [t for t in r.prompt_ids if not 0 <= t < vocab]
            if bad:
                raise EngineInputError(f"{which} has ids outside the model's vocabulary 0..{vocab - 1}: "
                                       f"{', '.join(map(str, bad[:5]))}{' ...' if len(bad) > 5 else ''}")
            if len(r.prompt_ids) > self.max_context:
                raise EngineInputError(f"{which} has {len(r.prompt_ids)} tokens, longer than the context of "
                                       f"{self.max_context} (raise --max-context)")
            if r.max_new_tokens < 1:
                raise EngineInputError(f"max new tokens must be at least 1, got {r.max_new_tokens}")
            if len(r.prompt_ids) + r.max_new_tokens - 1 > self.max_context:
                raise EngineInputError(f"{which} ({len(r.prompt_ids)} tokens) plus {r.max_new_tokens} new tokens "
                                       f"does not fit the context of {self.max_context}")
            r.sampling.validate()

    # ------------------------------------------------------------------------------------------ running
    @property
    def compile_count(self) -> int:
        """Programs compiled so far by this engine (one per distinct step shape)."""
        return len(self._programs.compiled)

    def generate(self, requests: Sequence[Request], *, on_tokens: TokenCallback | None = None,
                 on_prefill: ProgressCallback | None = None, record_logits: bool = False) -> GenerateResult:
        """Prefill every request's prompt, then decode until each hits an end id or its max new tokens."""
        self.check(requests)
        timings = Timings(prompt_tokens=sum(len(r.prompt_ids) for r in requests))
        compile_before = self._programs.compile_s
        count_before = self.compile_count
        cache = self._init_cache(self.cfg, len(requests), self.max_context, self.cache_dtype)
        cache, last_logits, prefill_logits = self._prefill(requests, cache, timings, on_prefill, record_logits)
        generations, decode_logits = self._decode(requests, cache, last_logits, timings, on_tokens, record_logits)
        timings.compile_s = self._programs.compile_s - compile_before
        timings.programs_compiled = self.compile_count - count_before
        return GenerateResult(generations, timings, prefill_logits, decode_logits)

    def _prefill(self, requests, cache, timings: Timings, on_prefill, record_logits):
        lengths = np.array([len(r.prompt_ids) for r in requests], np.int32)
        total = int(lengths.max())
        sizes = [int(n) for n in self.segment_plan(total)]
        if sum(sizes) != total or min(sizes) < 1:
            raise EngineInputError(f"segment plan {sizes} does not cover the {total}-token prompt")
        timings.segments = tuple(sizes)
        padded = np.zeros((len(requests), total), np.int32)
        for b, r in enumerate(requests):
            padded[b, : lengths[b]] = r.prompt_ids
        last_logits = jnp.zeros((len(requests), self.cfg.vocab_size), jnp.float32)
        first_rows = []
        start = 0
        for size in sizes:
            rows = bucket_rows(size, cap=max(sizes), min_bucket=self.min_bucket)
            ids = np.zeros((len(requests), rows), np.int32)
            ids[:, :size] = padded[:, start : start + size]
            seg_lengths = np.clip(lengths - start, 0, size).astype(np.int32)
            compile_mark = self._programs.compile_s
            t0 = time.perf_counter()
            cache, last_logits, first = self._programs.run(
                "prefill", _prefill_step, {"keep_first_row": record_logits},
                (self.state, cache, ids, seg_lengths, last_logits), donate=(2, 5))
            if record_logits:
                first_rows.append(np.asarray(first)[: min(size, max(0, int(lengths[0]) - start))])
            jax.block_until_ready(last_logits)
            timings.prefill_s += time.perf_counter() - t0 - (self._programs.compile_s - compile_mark)
            start += size
            if on_prefill:
                on_prefill(start, total)
        prefill_logits = np.concatenate(first_rows, axis=0) if record_logits else None
        return cache, last_logits, prefill_logits

    def _decode(self, requests, cache, logits, timings: Timings, on_tokens, record_logits):
        batch = len(requests)
        max_new = np.array([r.max_new_tokens for r in requests], np.int32)
        eos = np.array(self.eos_ids or (-1,), np.int32)
        sampling = sampling_arrays([r.sampling for r in requests])
        running = np.ones(batch, bool)
        produced: list[list[int]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        recorded = []
        step = 0
        while running.any():
            if record_logits and running[0]:
                recorded.append(np.asarray(logits)[0])
            compile_mark = self._programs.compile_s
            t0 = time.perf_counter()
            cache, tokens, logits, keep_going = self._programs.run(
                "decode", _decode_step, {},
                (self.state, cache, logits, running, eos, max_new, sampling, np.int32(step)), donate=(2, 3))
            tokens_np, keep_np = np.asarray(tokens), np.asarray(keep_going)
            timings.decode_s += time.perf_counter() - t0 - (self._programs.compile_s - compile_mark)
            timings.decode_steps += 1
            for b in np.flatnonzero(running):
                produced[b].append(int(tokens_np[b]))
                if int(tokens_np[b]) in self.eos_ids:
                    finish[b] = "eos"
            if on_tokens:
                on_tokens(step, tokens_np, running.copy())
            running = keep_np
            step += 1
        timings.generated_tokens = sum(len(p) for p in produced)
        generations = [Generation(tuple(r.prompt_ids), tuple(p), f) for r, p, f in zip(requests, produced, finish)]
        decode_logits = np.stack(recorded) if record_logits else None
        return generations, decode_logits
