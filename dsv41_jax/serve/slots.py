"""Continuous batching: a cache of S decode slots (static shapes) that requests enter and leave at any step.

Each slot holds one sequence: its rows of the S-slot cache (with its own ``offset``, i.e. position), its row of
the last-logits buffer, its sampling settings and seed key, and its own step counter (``sampling.sample`` folds
each sequence's *own* step into its key, so a request draws the same tokens in any slot next to any others).

Every decode step is the runtime's one step program, ``step[S, 1]`` (`runtime.STEP`: the model over one row per
slot, then sampling), with a step index per slot. Its outputs include the next step's inputs (each slot's token as
``ids``, ``lengths = keep_going``, ``running``, ``step + 1``: the *chain*), so steps follow each other on the
device as `Engine.generate` chains them, and the host reads each step's tokens one step behind, while the next
step runs: it reports them to the requests, and frees the slots of finished ones.

One `SlotEngine.step` (called in a loop by the one thread that owns the devices):

1. admit waiting requests while a slot is free (FIFO), reserving the slot;
2. prefill *long* prompts (more than ``short_rows`` tokens, or with images) within the step's token budget
   (``prefill_budget``, the server's ``--max-prefill-tokens``; vLLM's ``max_num_batched_tokens``): a long prompt is
   cut at the multiples of ``chunk`` (the budget, at most the planner's segment, PLANNER.md §A), and each step runs
   segments of the prompts in the prefill line, first come first (a prompt's next segments before the next
   prompt's), while their program rows (a segment rounded up to a power-of-two bucket) fit the budget: one
   prompt's, or the tails of several.
   Each segment is one call of the runtime's ``step[1, T]`` program (the one ``Engine.generate`` runs for one
   prompt) on the request's own *one-row* cache; its last segment draws the request's first token. A small program
   (``_insert_slot``) then copies that cache row, its last logits and its chain row (that token, its keep-going
   flag, step 1) into the reserved slot, at the end of the step (after 3 and 4: the copy waits for the prefill).
   A long prompt thus takes several steps, and the running streams decode in between: no stream waits more than
   one decode step plus one budget of prefill rows. A request's cut depends on its prompt and the budget alone,
   never on what else runs, so its tokens are those it gets alone;
3. decode: one ``step[S, 1]`` on the chain of the previous step; where the host has something to say (the next
   row of a *short* prompt, a slot whose request was cancelled), a small program (``_override``) first replaces
   those slots' rows of the chain. Short prompts (every segment at most ``short_rows`` rows) are prefilled row by
   row inside the decode steps, as the engine runs short segments through its decode program, so they cost no
   call of their own; the step that feeds a prompt's last row draws its first token. A slot with ``lengths`` 0
   (free, finished, cancelled, or prefilling apart) keeps its cache rows and logits untouched;
4. read the tokens of every call but those this step dispatched (they are read by the next step, while its calls
   run).

Prefix caching (`serve.prefix`, with a ``prefix_cache``): a long prompt's prefill state is kept at each multiple of
``chunk`` it reaches, keyed by the hash chain of its blocks, and a prompt whose leading blocks match starts its
prefill from the longest such snapshot (same cut, same state: the cold run's tokens). Prompts with images are cut
and prefilled the same way, each segment with its slice of the image rows (the tower runs once per request, at
its first segment; `Runtime.encode_images`), and are never prefix-cached; their decode steps are text.

Why the prefill and the decode step stay two programs, not one: one program holding both forwards would save a
launch, not a read of the experts (the rows of two forwards do not share a matmul); sharing those reads needs one
forward over the decode rows and the prefill rows together, a ragged batch of different caches, which the model
does not have.

Engram models (`MODEL.md` §B.12) hash each step's ids on the host, so there the host reads every token before it
dispatches the next step and feeds every slot's row itself (as `Engine.generate` does for them).

Why a long prompt prefills into one row and is copied, rather than by a forward over all S slots with
``lengths`` 0 for the others: the S-slot forward computes S x T rows for one prompt's T (every row of a static
batch is computed, padding or not), so its cost grows with the slot count; the one-row prefill costs T rows
whatever S is, and the copy is one dynamic-update-slice per cache leaf (measured: see docs/BENCHMARKS.md, section
"Figures recorded in docs/DESIGN.md until it held contracts only"). It also makes a request's prefill independent
of what else runs.

A finished request (end id, ``max_new_tokens``: its slot's chain already stopped on the device; one of its
``stop_ids``, read by the host, which stops the slot's chain from the next step; or `cancel`: a stop string, a
client gone) frees its slot when the host reads it (at once for a cancel); the next admission overwrites the
slot's row whole (the insert of a fresh one-row cache for a short prompt). A job that asks for log-probs reads
them with its tokens (the step with the sampling arrays returns them; the host fetches them only then).

Penalties (presence, frequency, repetition) need each request's token counts: the slots keep them on the device
(counts [S, V], the prompts' ids [S, V]), passed to the step in its sampling arrays, counted after each decode step
that has a penalised request (``count``) and reset when one takes a slot (``reset_counts``). A penalised long
prompt's first token is drawn by the decode step after its prefill (which has its counts), not by the prefill.

Programs: ``init[1]``, ``init[S]``, ``step[S, 1]`` (per-slot steps; twice: with the sampling arrays and the
penalties' state, and the argmax-only variant run while every slot is plain greedy and wants no log-probs, which
skips the filters' sort of the vocabulary), ``insert``, ``override``, ``count``, ``reset_counts``, ``copy`` (with
a prefix cache; serving's own, registered in the runtime's table) and ``step[1, T]`` per bucket above
``short_rows`` up to ``chunk`` — all compiled by `precompile` (a prompt with images compiles its ``step[1, T]`` on
first use, as the engine's do: their shapes are known after encoding); slots are reused without compiling anything
(tests/test_serve.py counts JAX's compile events in the server).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..engine import Engine, EngineInputError, Request, bucket_rows, fixed_segments
from ..runtime import Program, keeps_going, segment_images, stop_ids
from ..sampling import SamplingArrays, sampling_arrays
from .prefix import PrefixCache, Snapshot, block_hashes, tree_bytes

# (kind, value): ("token", id) for each generated token (preceded, for a job that asks for log-probabilities, by
# ("logprobs", (the token's, the top ids, their log-probs))), then ("done", finish_reason) once: 'stop' (an end id
# or one of the job's stop ids; the id itself is not reported), 'length' or 'cancelled'; ("error", message) on
# failure.
EventSink = Callable[[str, object], None]


def _insert_slot(cache, logits, chain, one_cache, one_logits, one_chain, slot):
    """Copy a one-row cache, its last logits [1, V] and its chain row into row ``slot`` of the S-slot cache,
    logits [S, V] (both donated) and chain (ids [S, 1], lengths [S], running [S], step [S]): every leaf's rows
    [slot] (offsets included) are replaced, so nothing of the slot's last user stays."""

    def put(big, small):
        return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, axis=0)

    return jax.tree.map(put, cache, one_cache), put(logits, one_logits), jax.tree.map(put, chain, one_chain)


def _count(counts, tokens, mask, running):
    """The penalties' token counts [S, V] i32 (donated) plus one at each row's token (``tokens`` [S, 1], a step's
    draws) where the host's ``mask`` [S] (the step's draw is a generated token) and the step's ``running`` [S]
    input (the device had not stopped the row: an end id, the last new token) are set."""
    add = (mask & running).astype(counts.dtype)
    return counts.at[jnp.arange(counts.shape[0]), tokens[:, 0]].add(add)


def _reset_counts(counts, seen, slot, seen_row):
    """Row ``slot`` of the counts [S, V] zeroed and of ``seen`` [S, V] (the prompts' ids; both donated) set to
    ``seen_row`` [V]: a penalised request takes the slot."""
    zeros = jnp.zeros((1, counts.shape[1]), counts.dtype)
    return (jax.lax.dynamic_update_slice_in_dim(counts, zeros, slot, axis=0),
            jax.lax.dynamic_update_slice_in_dim(seen, seen_row[None], slot, axis=0))


def _override(chain, mask, values):
    """The chain (ids [S, 1], lengths [S], running [S], step [S]) with the rows where ``mask [S]`` is set taken
    from ``values`` (same shapes, from the host)."""
    return jax.tree.map(lambda old, new: jnp.where(mask.reshape((-1,) + (1,) * (old.ndim - 1)), new, old),
                        chain, values)


def _copy(tree):
    """Fresh buffers holding ``tree``'s values: a prefix snapshot (the prefill donates the cache it reads)."""
    return jax.tree.map(jnp.copy, tree)


# Serving's own programs in the runtime's table: a slot's admission and the host's overrides of the chain.
INSERT = Program("insert", _insert_slot, donate=(0, 1), model=False)
OVERRIDE = Program("override", _override, model=False)
# The penalties' state (`sampling.SamplingArrays.counts`): counted after each step, reset for a new request.
COUNT = Program("count", _count, donate=(0,), model=False)
RESET_COUNTS = Program("reset_counts", _reset_counts, donate=(0, 1), model=False)
COPY = Program("copy", _copy, model=False)  # prefix caching: a snapshot and its restore


def _host_chain(batch: int) -> tuple:
    """Idle chain rows on the host: (ids [B, 1], lengths [B], running [B], step [B])."""
    return (np.zeros((batch, 1), np.int32), np.zeros(batch, np.int32), np.zeros(batch, bool),
            np.zeros(batch, np.int32))


@dataclass
class Job:
    """One request in the slot engine. ``sink`` gets its events on the engine thread. ``steps`` and ``last``: the
    tokens read so far and the last one (the host's view, a step behind)."""

    id: int
    request: Request
    sink: EventSink
    logprobs: int | None = None  # the top log-probs each token reports with its own (None: none reported)
    stop_ids: frozenset = frozenset()  # ids that end the request as an end id does (checked by the host)
    draw_first: bool = False  # prefilled apart with penalties: its first token is drawn by a decode step
    constraint: object = None  # structured.Constraint: its grammar masks each draw (the host reads every step)
    prompt_done: int = 0
    segments: list = field(default_factory=list)  # remaining prefill segment sizes
    prefill: object = None  # a long prompt's one-row state between its segments (`_Prefill`)
    blocks: list = field(default_factory=list)  # prefix caching: the keys of its prompt's whole chunks
    slot: int = -1
    cancelled: bool = False
    finished: bool = False
    steps: int = 0
    last: int = 0


class _Prefill(NamedTuple):
    """A long prompt's one-row state between its segments: cache, last logits [1, V], engram history, the
    prefill's stop inputs, the encoded images (`Runtime.encode_images`) or None."""

    cache: object
    logits: object
    history: object
    stop: tuple
    images: object


def chunk_rows(engine: Engine, prefill_budget: int | None, short_rows: int) -> int:
    """The prefill chunk: ``prefill_budget`` (None: the planner's segment), at most the planner's segment for the
    engine's context, rounded down to a multiple of every compress ratio (a block of the prefix cache then closes
    every compressed group). EngineInputError for a budget not above ``short_rows`` (every prompt would feed row by
    row; a planner's segment not above it is the engine's choice: prompts then feed row by row, as the engine's)."""
    longest = max(int(n) for n in engine.segment_plan(engine.max_context))
    chunk = longest if prefill_budget is None else min(int(prefill_budget), longest)
    align = math.lcm(1, *(r for r in engine.cfg.compress_ratios if r > 0))
    chunk -= chunk % align
    if prefill_budget is not None and prefill_budget <= short_rows:
        raise EngineInputError(f"the prefill budget ({prefill_budget} tokens) must be above the short-prompt rows "
                               f"({short_rows}): shorter prompts feed row by row in the decode steps")
    return chunk


class SlotEngine:
    """S decode slots over ``engine``'s model and runtime (see the module docstring). ``short_rows`` (default the
    engine's): prompts of at most this many tokens (without images) prefill row by row in the decode steps.
    ``prefill_budget``: the program rows of long-prompt prefill a scheduling step runs beside its decode step
    (default: the planner's segment, `chunk_rows`). ``prefix_cache``: a `PrefixCache` (None: off), kept by
    `fresh`."""

    def __init__(self, engine: Engine, slots: int, short_rows: int | None = None, *,
                 prefill_budget: int | None = None, prefix_cache: PrefixCache | None = None):
        if slots < 1:
            raise EngineInputError(f"the slot count must be at least 1, got {slots}")
        self.engine = engine
        self.runtime = engine.runtime
        self.runtime.register(INSERT, OVERRIDE, COUNT, RESET_COUNTS, COPY)
        self.slots = slots
        self.short_rows = engine.short_rows if short_rows is None else short_rows
        self.prefill_budget = prefill_budget
        self.chunk = chunk_rows(engine, prefill_budget, self.short_rows)
        self.budget = self.chunk if prefill_budget is None else max(int(prefill_budget), self.chunk)
        self._rows: list[int] | None = None
        one = jax.eval_shape(lambda: (self.runtime.empty_cache(1, engine.max_context),
                                      jnp.zeros((1, engine.vocab_size), jnp.float32)))
        self.snapshot_bytes = tree_bytes(one)  # one prefix snapshot: a one-row cache and its logits
        # Off (None) without a cache or where one snapshot is larger than its whole budget.
        self.prefix_cache = prefix_cache if prefix_cache is not None and \
            prefix_cache.capacity >= self.snapshot_bytes else None
        self.waiting: collections.deque[Job] = collections.deque()
        self.prefilling: collections.deque[Job] = collections.deque()  # long prompts: slot reserved, not done
        self.running: list[Job | None] = [None] * slots  # by slot: feeding a short prompt, or decoding
        self._reserved = [False] * slots
        self._host_feed = engine.hasher is not None  # engram: the host hashes (so reads) every step's ids
        self._eos = engine.stop_ids()
        self._no_eos = stop_ids(())  # the end ids of a request that ignores them
        vocab = engine.vocab_size  # the penalties' state, on the device (`sampling.SamplingArrays`)
        self._sampling = dataclasses.replace(  # every id allowed: a grammar's mask replaces its rows per step
            sampling_arrays([Request(()).sampling] * slots, penalties=True),
            allowed=np.full((slots, -(-vocab // 32)), -1, np.int32))
        self._counts, self._seen = self.runtime.place((np.zeros((slots, vocab), np.int32),
                                                       np.zeros((slots, vocab), bool)))
        self._max_new = np.ones(slots, np.int32)
        self._stop: dict[bool, tuple] = {}  # greedy? -> (eos, max_new, sampling | None) on the device
        self._history = self.runtime.empty_history(slots)
        self._cache = self._run_init(slots)
        self._logits = np.zeros((slots, engine.vocab_size), np.float32)
        self._chain = _host_chain(slots)  # the next step's (ids, lengths, running, step): device or host arrays
        self._halt = np.zeros(slots, bool)  # slots whose request the host dropped while the chain runs it
        self._pending: collections.deque = collections.deque()  # (tokens, [(row, job)]) not read yet
        self._queued = 0  # calls queued in `_pending` so far
        self._step_programs: dict = {}  # greedy? -> the compiled step[S, 1], looked up once
        self.decode_steps = 0
        self.greedy_steps = 0  # decode steps run by the argmax-only variant
        self.prefill_calls = 0
        self.prefill_rows = 0  # prompt tokens computed by long prefills (a prefix hit's are not)
        # program rows of long prefill in each of the last steps that had a prompt to prefill
        self.prefill_per_step: collections.deque[int] = collections.deque(maxlen=4096)

    def fresh(self) -> "SlotEngine":
        """A new slot engine of the same kind and settings over the same engine and prefix cache (a reset); the
        prefilled-rows count goes on (a counter of the server's)."""
        new = type(self)(self.engine, self.slots, self.short_rows, prefill_budget=self.prefill_budget,
                         prefix_cache=self.prefix_cache)
        new.prefill_rows = self.prefill_rows
        return new

    # ------------------------------------------------------------------------------------------ programs
    def release(self) -> None:
        """Drop this engine's device buffers (cache, logits, chain, stop constants); it runs no step after."""
        self._cache = self._logits = self._chain = None
        self._stop = {}

    def _prefill_rows(self) -> list[int]:
        """The one-row prefill program sizes: the buckets of segments longer than ``short_rows``, up to ``chunk``
        (``chunk`` alone when ``short_rows`` is not below it: then only image prompts prefill apart)."""
        if self._rows is None:
            low = min(self.short_rows, self.chunk - 1) + 1
            self._rows = sorted({bucket_rows(n, self.chunk) for n in range(low, self.chunk + 1)})
        return self._rows

    def _bucket(self, size: int) -> int:
        """The program rows a segment of ``size`` runs in (a short tail: the smallest long bucket)."""
        return min(t for t in self._prefill_rows() if t >= size)

    def precompile(self) -> float:
        """Compile every program serving can need (module docstring); returns compile seconds."""
        rt, positions, eos = self.runtime, self.engine.max_context, len(self._eos)
        before = rt.compile_s
        calls = [rt.init_call(self.slots, positions), rt.init_call(1, positions)]
        full, greedy = (rt.step_call(self.slots, 1, positions, eos, greedy=g, slot_steps=True) for g in (False, True))
        calls += [greedy, full._replace(args=(*full.args[:9], rt.abstract(self._penalised(self._sampling)),
                                              *full.args[10:]))]
        calls += [rt.step_call(1, t, positions, eos) for t in self._prefill_rows() if t != 1]
        rt.compile(calls)
        self._run_insert(self._run_init(1), np.zeros((1, rt.vocab_size), np.float32), _host_chain(1), 0)
        self._chain = self._run_override(np.zeros(self.slots, bool), _host_chain(self.slots))  # dry runs
        self._run_reset_counts(0, np.zeros(rt.vocab_size, bool))
        if self.prefix_cache is not None:
            one = self._run_init(1)
            rt.run(COPY, {}, ((one, np.zeros((1, rt.vocab_size), np.float32)),))
        self._counts = rt.run(COUNT, {}, (self._counts, self._chain[0], np.zeros(self.slots, bool), self._chain[2]))
        sampling_arrays([Request(()).sampling])  # its one-request key op, so the first request compiles nothing
        return rt.compile_s - before

    def _run_init(self, batch: int):
        return self.runtime.init_cache(batch, self.engine.max_context)

    def _run_insert(self, one_cache, one_logits, one_chain, slot: int) -> None:
        self._cache, self._logits, self._chain = self.runtime.run(
            INSERT, {}, (self._cache, self._logits, self._chain, one_cache, one_logits, one_chain, np.int32(slot)))

    def _run_override(self, mask: np.ndarray, values: tuple) -> tuple:
        return self.runtime.run(OVERRIDE, {}, (self._chain, mask, values))

    def _run_reset_counts(self, slot: int, seen_row: np.ndarray) -> None:
        self._counts, self._seen = self.runtime.run(RESET_COUNTS, {}, (self._counts, self._seen, np.int32(slot),
                                                                       seen_row))

    def _penalised(self, sampling: SamplingArrays) -> SamplingArrays:
        """``sampling`` with the penalties' state on the device (the counts as of the last step)."""
        return dataclasses.replace(sampling, counts=self._counts, seen=self._seen)

    def _placed_stop(self, greedy: bool) -> tuple:
        """The step's (eos ids, max new [S], sampling arrays with the penalties' state, or None when ``greedy``)
        on the device; the settings placed again after an admission."""
        if greedy not in self._stop:
            host = jax.tree.map(np.copy, (self._eos, self._max_new, None if greedy else self._sampling))
            self._stop[greedy] = self.runtime.place(host)  # never aliased, then changed
        eos, max_new, sampling = self._stop[greedy]
        return eos, max_new, None if sampling is None else self._penalised(sampling)

    # ------------------------------------------------------------------------------------------ requests
    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self._pending or any(j is not None for j in self.running))

    @property
    def active(self) -> int:
        """Requests holding a slot (prefilling or decoding)."""
        return sum(self._reserved)

    @property
    def cache_usage(self) -> float:
        """The fraction of the cache's positions (slots x context) that hold a request's tokens: what each
        request in a slot has prefilled and generated (read by the metrics from another thread: a gauge)."""
        jobs = [j for j in [*list(self.running), *list(self.prefilling)] if j is not None]
        return sum(j.prompt_done + j.steps for j in jobs) / (self.slots * self.engine.max_context)

    def penalty_state(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """(each id's count among the generated tokens [V], the prompt's ids [V] bool) that slot ``slot``'s last
        penalised request was penalised with (read from the device)."""
        return np.asarray(self._counts[slot]), np.asarray(self._seen[slot])

    def add(self, job: Job) -> None:
        """Queue a request (checked here: EngineInputError for one the engine cannot run)."""
        self.engine.check([job.request])
        if job.request.images is not None and not self.runtime.has_vision:
            raise EngineInputError("this model has no vision tower: image prompts need a checkpoint with a "
                                   "vision_config, loaded with its image path")
        job.segments = fixed_segments(len(job.request.prompt_ids), self.chunk)
        self.waiting.append(job)

    def cancel(self, job_id: int) -> None:
        """Stop a request wherever it is; its slot is free for the next step."""
        for job in [*self.waiting, *self.prefilling, *self.running]:
            if job is not None and job.id == job_id:
                job.cancelled = True

    # ------------------------------------------------------------------------------------------ stepping
    def step(self) -> None:
        """One scheduling step: admit, long-prefill segments within the budget, one decode step, read what is
        done (module docstring)."""
        self._drop_cancelled()
        self._admit()
        before = self._queued
        prefilled = self._prefill_within_budget() if self.prefilling else []
        decoding = any(j is not None for j in self.running)
        if decoding:
            self._decode_step()
        # This step's calls are read by the next one, while the next step's calls run.
        self._read(min(self._queued - before, len(self._pending)) if decoding and not self._host_feed else 0)
        for job, out, history in prefilled:  # after the decode step and the read: see `_join_prefilled`
            self._join_prefilled(job, out, history)

    def _queue(self, entry: tuple) -> None:
        """A dispatched call's (tokens, [(row, job)], log-probs | None), read later by `_read`."""
        self._pending.append(entry)
        self._queued += 1

    def _drop_cancelled(self) -> None:
        for queue in (self.waiting, self.prefilling):
            for job in [j for j in queue if j.cancelled]:
                job.prefill = None
                queue.remove(job)
                if job.slot >= 0:
                    self._reserved[job.slot] = False
                job.finished = True
                job.sink("done", "cancelled")
        for b, job in enumerate(self.running):
            if job is not None and job.cancelled:
                self._halt[b] = True  # its chain may still run: the next step feeds the slot nothing
                self._finish(job, "cancelled")

    def _admit(self) -> None:
        while self.waiting and not all(self._reserved):
            job = self.waiting.popleft()
            job.slot = self._reserved.index(False)
            self._reserved[job.slot] = True
            if max(job.segments) <= self.short_rows and job.request.images is None:
                self._join(job, self._run_init(1), np.zeros((1, self.engine.vocab_size), np.float32),
                           _host_chain(1), self.runtime.empty_history(1))
            else:
                self.prefilling.append(job)

    def _join(self, job: Job, one_cache, one_logits, one_chain, history) -> None:
        """``job`` takes its slot: the slot's cache row, logits and chain row become the one-row ones (its
        prefill, or a fresh cache and an idle chain row for a short prompt that feeds in the decode steps), with
        its settings."""
        b, r = job.slot, job.request
        self._run_insert(one_cache, one_logits, one_chain, b)
        self._halt[b] = False
        if self._history is not None:
            self._history[b] = history[0]
        one = sampling_arrays([r.sampling], penalties=True)
        for name in SamplingArrays.__dataclass_fields__:
            if getattr(one, name) is not None:
                getattr(self._sampling, name)[b] = getattr(one, name)[0]
        if r.sampling.penalised:  # its counts from zero; the prompt's ids for the repetition penalty
            seen_row = np.zeros(self.engine.vocab_size, bool)
            seen_row[list(r.prompt_ids)] = True
            self._run_reset_counts(b, seen_row)
        self._max_new[b] = r.max_new_tokens
        self._stop = {}
        self.running[b] = job

    def _prefill_within_budget(self) -> list[tuple]:
        """The next segment of each prompt in the prefill line, in order, while their program rows fit the
        budget (the first always does: a segment is at most ``chunk`` rows) -> (job, StepOut, engram history) of
        each prompt whose last segment ran."""
        left, prefilled = self.budget, []
        for job in list(self.prefilling):
            if job.prefill is None:
                self._start_prefill(job)
            elif isinstance(job.prefill.logits, jax.Array):
                # Its last segment (an earlier step's) is done before more are queued: on an in-order device
                # the decode step queued after it still runs meanwhile. A backend that runs independent programs
                # side by side (XLA's CPU client) would otherwise let the prefill chain fall behind the decode
                # chain, and the prompt's join would wait for the whole backlog.
                jax.block_until_ready(job.prefill.logits)
            done = None
            while job.segments and self._bucket(job.segments[0]) <= left:
                left -= self._bucket(job.segments[0])
                done = self._prefill_segment(job)
            if done is not None:
                prefilled.append((job, *done))
            if job.segments:
                break  # first come first: the next prompt waits for this one's next step
        self.prefill_per_step.append(self.budget - left)
        return prefilled

    def _start_prefill(self, job: Job) -> None:
        """A long prompt's one-row state before its first segment: fresh, or a prefix snapshot's copy (its
        segments then start at the snapshot's block); its images encoded (the tower once a request)."""
        rt, r = self.runtime, job.request
        # A penalised request's first token is drawn by a decode step (which has its counts): its prefill's
        # draw, without penalties, is not used.
        sampling = dataclasses.replace(r.sampling, presence_penalty=0.0, frequency_penalty=0.0,
                                       repetition_penalty=1.0)
        stop = rt.stop_inputs(self.engine.eos_ids, [r.max_new_tokens], [sampling])
        images = rt.encode_images([r.images], len(r.prompt_ids)) if r.images is not None else None
        snapshot = None
        if self.prefix_cache is not None and r.images is None:
            job.blocks = block_hashes(r.prompt_ids, self.chunk, len(r.prompt_ids) // self.chunk)
            usable = (len(r.prompt_ids) - 1) // self.chunk  # at least one row is left: it draws the first token
            snapshot = self.prefix_cache.lookup(job.blocks[:usable], len(r.prompt_ids))
        if snapshot is None:
            job.prefill = _Prefill(self._run_init(1), np.zeros((1, rt.vocab_size), np.float32),
                                   rt.empty_history(1), stop, images)
            return
        cache, logits = rt.run(COPY, {}, ((snapshot.cache, snapshot.logits),))
        history = None if snapshot.history is None else snapshot.history.copy()
        job.prefill = _Prefill(cache, logits, history, stop, None)
        job.prompt_done = snapshot.tokens
        del job.segments[:snapshot.tokens // self.chunk]

    def _keep_snapshot(self, job: Job, cache, logits, history) -> None:
        """After a segment that ends on a block boundary: the state there, kept by the prefix cache unless it has
        it (a copy: the next segment donates ``cache``)."""
        done = job.prompt_done
        if self.prefix_cache is None or not job.blocks or done % self.chunk:
            return
        key = job.blocks[done // self.chunk - 1]
        if key in self.prefix_cache:
            return
        cache, logits = self.runtime.run(COPY, {}, ((cache, logits),))
        history = None if history is None else np.array(history)
        self.prefix_cache.put(key, Snapshot(done, cache, logits, history, self.snapshot_bytes))

    def _prefill_segment(self, job: Job) -> tuple | None:
        """The next segment of ``job``'s prompt -> None, or after its last segment (which draws the first token)
        that call's (StepOut, engram history)."""
        rt, state = self.runtime, job.prefill
        size = job.segments.pop(0)
        ids = np.zeros((1, self._bucket(size)), np.int32)
        ids[0, :size] = job.request.prompt_ids[job.prompt_done:job.prompt_done + size]
        images = segment_images(state.images, job.prompt_done, size, ids.shape[1])
        out, history = rt.prefill(state.cache, state.logits, ids, np.array([size], np.int32), state.stop,
                                  state.history, images)
        job.prompt_done += size
        self.prefill_calls += 1
        self.prefill_rows += size
        self._keep_snapshot(job, out.cache, out.last_logits, history)
        if job.segments:
            job.prefill = state._replace(cache=out.cache, logits=out.last_logits, history=history)
            return None
        job.prefill = None
        self.prefilling.remove(job)
        return out, history

    def _join_prefilled(self, job: Job, out, history) -> None:
        """A prefilled request takes its slot, with the first token its last segment drew (read by the next step).
        Run at the end of the step, after its decode step (whose row of the slot is idle, then overwritten) and
        its read: the copy waits for the prefill where a backend runs a small program inline (XLA's CPU client),
        and would otherwise hold the decode step and the streams' tokens back by that long."""
        if job.request.sampling.penalised or job.constraint is not None:  # the next decode step draws token 0
            # (step 0) from these logits, with the counts and the grammar's mask the prefill program lacks
            job.draw_first = True
            self._join(job, out.cache, out.last_logits, (np.zeros((1, 1), np.int32), np.zeros(1, np.int32),
                                                         np.ones(1, bool), np.zeros(1, np.int32)), history)
            return
        # Token 0 was drawn with step 0: the slot's chain goes on at step 1.
        self._join(job, out.cache, out.last_logits, (out.tokens, out.lengths, out.keep_going, np.ones(1, np.int32)),
                   history)
        self._queue((out.tokens, [(0, job)], out.logprobs if job.logprobs is not None else None))

    def _decode_step(self) -> None:
        """One ``step[S, 1]``: on the previous step's chain, with the host's rows where it has any (a short
        prompt's next row, a cancelled slot; every slot for engram models)."""
        rt = self.runtime
        constrained = any(j is not None and j.constraint is not None for j in self.running)
        if self._host_feed or constrained:
            self._read(0)  # the host hashes the ids, or a grammar's mask follows the last token: all read first
            if all(j is None for j in self.running):
                return  # every request ended with the tokens just read
            constrained = any(j is not None and j.constraint is not None for j in self.running)
        mask = self._halt.copy()
        values = _host_chain(self.slots)
        ids, lengths, running, steps = values
        emit = []  # (slot, job): slots whose draw this step is a generated token
        for b, job in enumerate(self.running):
            if job is None:
                continue
            prompt = job.request.prompt_ids
            if job.prompt_done < len(prompt):  # a short prompt's next row; its last draws token 0
                mask[b] = True
                ids[b, 0], lengths[b], running[b] = prompt[job.prompt_done], 1, True
                job.prompt_done += 1
                if job.prompt_done < len(prompt):
                    continue
            elif self._host_feed:
                mask[b] = True
                ids[b, 0], lengths[b], running[b], steps[b] = job.last, int(not job.draw_first), True, job.steps
            job.draw_first = False
            emit.append((b, job))
        self._halt[:] = False
        if self._host_feed:
            chain = values
        elif mask.any():
            chain = self._run_override(mask, values)
        else:
            chain = self._chain
        # Every slot plain greedy (idle ones are) and no log-probs asked for: the argmax-only step, without the
        # sampling filters' sort of the vocabulary (`sampling` module docstring).
        greedy = not constrained and all(job is None or (job.request.sampling.argmax_only and job.logprobs is None)
                                         for job in self.running)
        stop = self._placed_stop(greedy)
        if constrained:
            stop = (*stop[:2], dataclasses.replace(stop[2], allowed=rt.place(self._grammar_masks())))
        args, self._history = rt.step_args(self._cache, self._logits, *chain, stop, self._history)
        if greedy not in self._step_programs:
            self._step_programs[greedy] = rt.step_program(args)
        out = self._step_programs[greedy](*args)
        self.greedy_steps += greedy
        self._cache, self._logits = out.cache, out.last_logits
        self._chain = (out.tokens, out.lengths, out.keep_going, out.next_step)
        logprobs = out.logprobs if any(job.logprobs is not None for _, job in emit) else None
        self._queue((out.tokens, emit, logprobs))
        if any(job.request.sampling.penalised for _, job in emit):  # the counts the next step penalises with
            counted = np.zeros(self.slots, bool)
            counted[[b for b, _ in emit]] = True
            self._counts = rt.run(COUNT, {}, (self._counts, out.tokens, counted, chain[2]))
        for array in (out.tokens, *(logprobs or ())):
            rt.fetch(array)  # _read reads them next: their copy starts when they are ready
        self.decode_steps += 1

    def _grammar_masks(self) -> np.ndarray:
        """The step's allowed ids [S, W] bitmask words: each constrained slot's grammar after its last token,
        every id elsewhere."""
        masks = np.array(self._sampling.allowed)
        constraints = [j.constraint if j is not None else None for j in self.running]
        vocab = next(c.vocab for c in constraints if c is not None)
        vocab.fill_masks(constraints, masks)
        return masks

    def _read(self, in_flight: int) -> None:
        """Read the tokens of all but the newest ``in_flight`` dispatched calls: report them (with their
        log-probs where asked), free the slots of requests that end (an end id, unless the request ignores them,
        or one of its stop ids: 'stop', not reported; the last new token: 'length')."""
        while len(self._pending) > in_flight:
            tokens, emit, logprobs = self._pending.popleft()
            tokens = self.runtime.read(tokens)[:, 0]
            if logprobs is not None:
                logprobs = [self.runtime.read(a) for a in logprobs]
            for row, job in emit:
                if job.finished or job.cancelled:
                    continue  # its slot was freed while this call ran
                token = int(tokens[row])
                ignore_eos = job.request.sampling.ignore_eos
                keep = bool(keeps_going(True, tokens[row:row + 1], self._no_eos if ignore_eos else self._eos,
                                        job.steps, job.request.max_new_tokens)[0])  # the step's own rule
                job.steps, job.last = job.steps + 1, token
                if token in job.stop_ids:  # the device's chain goes on: the next step feeds the slot nothing
                    self._halt[job.slot] = True
                    self._finish(job, "stop")
                    continue
                if token in self.engine.eos_ids and not ignore_eos:
                    self._finish(job, "stop")
                    continue
                if job.constraint is not None:
                    job.constraint.advance(token)
                if job.logprobs is not None:
                    token_lp, top_ids, top = (a[row] for a in logprobs)
                    job.sink("logprobs", (float(token_lp), top_ids[:job.logprobs].tolist(),
                                          top[:job.logprobs].tolist()))
                job.sink("token", token)
                if not keep:
                    self._finish(job, "length")

    def _finish(self, job: Job, reason: str) -> None:
        job.finished = True
        self.running[job.slot] = None
        self._reserved[job.slot] = False
        job.sink("done", reason)
