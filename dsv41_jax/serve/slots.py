"""Continuous batching: a cache of S decode slots (static shapes) that requests enter and leave at any step.

Each slot holds one sequence: its rows of the S-slot cache (with its own ``offset``, i.e. position), its row of
the last-logits buffer, its sampling settings and seed key, and its own step counter (``sampling.sample`` folds
each sequence's *own* step into its key, so a request draws the same tokens in any slot next to any others).

One `SlotEngine.step` (called in a loop by the one thread that owns the devices):

1. admit waiting requests while a slot is free (FIFO), reserving the slot;
2. prefill a *long* prompt (a segment of more than ``short_rows`` rows, PLANNER.md §A): one planner-sized
   segment of the request at the head of the prefill line, through the engine's own ``forward[1, T]`` program
   into a *one-row* cache (T: the segment rounded up to a power-of-two bucket); after its last segment a small
   donating program (``_insert_slot``) copies that cache row and its last logits into the reserved slot. A
   prompt of several segments thus takes several steps, and the running streams decode in between;
3. decode: the engine's ``sample[S]`` (per-slot steps) then ``forward[S, 1]``, fed each decoding slot's new
   token and each *short* prompt's next row (short prompts — every segment at most ``short_rows`` rows — are
   prefilled row by row inside the decode steps, as the engine runs short segments through its decode program,
   so they cost no call of their own and no program beyond the decode one); ``lengths`` is 0 for the other
   slots (free, finished, cancelled, or prefilling apart), whose cache rows and logits stay untouched
   (`engine._forward`).

Why a long prompt prefills into one row and is copied, rather than by a forward over all S slots with
``lengths`` 0 for the others: the S-slot forward computes S x T rows for one prompt's T (every row of a static
batch is computed, padding or not), so its cost grows with the slot count; the one-row prefill costs T rows
whatever S is, and the copy is one dynamic-update-slice per cache leaf (`docs/DESIGN.md` "Serving" has the
CPU measurement). It also makes a request's prefill independent of what else runs.

A finished request (end id, ``max_new_tokens``, or `cancel`: a stop string, a client gone) frees its slot at
once: the next decode step feeds it length 0 and the next admission overwrites its row whole (the insert of a
fresh one-row cache for a short prompt).

Programs: ``init[1]``, ``init[S]``, ``forward[S, 1]``, ``sample[S]``, ``insert`` and ``forward[1, T]`` per
bucket above ``short_rows`` — all compiled by `precompile` through the engine's program table; slots are reused
without compiling anything (tests/test_serve.py counts JAX's compile events in the server).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..engine import Engine, EngineInputError, Request, _fresh_cache, _sample_step, bucket_rows
from ..sampling import sampling_arrays

# (kind, value): ("token", id) for each generated token, then ("done", finish_reason) once:
# 'stop' (an end id; the id itself is not reported), 'length' or 'cancelled'; ("error", message) on failure.
EventSink = Callable[[str, object], None]


def _insert_slot(graphdef, cache, logits, one_cache, one_logits, slot):
    """Copy a one-row cache and its last logits into row ``slot`` of the S-slot cache / logits [S, V] (both
    donated): every leaf's rows [slot] (offsets included) are replaced, so nothing of the slot's last user stays."""
    del graphdef

    def put(big, small):
        return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, axis=0)

    return jax.tree.map(put, cache, one_cache), put(logits, one_logits)


@dataclass
class Job:
    """One request in the slot engine. ``sink`` gets its events on the engine thread."""

    id: int
    request: Request
    sink: EventSink
    prompt_done: int = 0
    segments: list = field(default_factory=list)  # remaining prefill segment sizes
    slot: int = -1
    cancelled: bool = False


class SlotEngine:
    """S decode slots over ``engine``'s model and program table (see the module docstring). ``short_rows``
    (default the engine's): prompts whose segments are all at most this long prefill row by row in the decode
    steps."""

    def __init__(self, engine: Engine, slots: int, short_rows: int | None = None):
        if slots < 1:
            raise EngineInputError(f"the slot count must be at least 1, got {slots}")
        self.engine = engine
        self.slots = slots
        self.short_rows = engine.short_rows if short_rows is None else short_rows
        self._longest = max(int(n) for n in engine.segment_plan(engine.max_context))
        self._rows: list[int] | None = None
        self.waiting: collections.deque[Job] = collections.deque()
        self.prefilling: collections.deque[Job] = collections.deque()  # long prompts: slot reserved, not done
        self.running: list[Job | None] = [None] * slots  # by slot: feeding a short prompt, or decoding
        self._reserved = [False] * slots
        self._eos = np.array(engine.eos_ids or (-1,), np.int32)
        self._sampling = sampling_arrays([Request(()).sampling] * slots)
        self._max_new = np.ones(slots, np.int32)
        self._steps = np.zeros(slots, np.int32)
        self._history = engine._empty_history(slots)
        self._one = None  # (one-row cache, logits [1, V], engram history) of the long prefill in progress
        self._cache = self._run_init(slots)
        self._logits = jnp.zeros((slots, engine.vocab_size), jnp.float32)
        self.decode_steps = 0
        self.prefill_calls = 0

    # ------------------------------------------------------------------------------------------ programs
    def _prefill_rows(self) -> list[int]:
        """The one-row prefill program sizes: the buckets of segments longer than ``short_rows``."""
        if self._rows is None:
            self._rows = sorted({bucket_rows(n, self._longest) for n in range(self.short_rows + 1,
                                                                               self._longest + 1)})
        return self._rows

    def precompile(self) -> float:
        """Compile every program serving can need (module docstring); returns compile seconds."""
        e = self.engine
        before = e._programs.compile_s
        specs = [s for s in e._split_specs(self.slots, [1], False) if s[0] != "sample"]
        rows = self._prefill_rows()
        specs += [s for s in e._split_specs(1, rows, False) if s[0] == "init" or (s[0] == "forward" and rows
                                                                             and s[3][2].shape[1] != 1)]
        e._programs.ensure(specs)
        self._run_sample(np.zeros(self.slots, bool))  # sample[S] with per-slot steps and insert: on a dry run
        self._run_insert(self._run_init(1), jnp.zeros((1, e.vocab_size), jnp.float32), 0)
        sampling_arrays([Request(()).sampling])  # its one-request key op, so the first request compiles nothing
        return e._programs.compile_s - before

    def _run_init(self, batch: int):
        e = self.engine
        return e._programs.run("init", _fresh_cache, e._init_static(batch), ())

    def _run_insert(self, one_cache, one_logits, slot: int) -> None:
        self._cache, self._logits = self.engine._programs.run(
            "insert", _insert_slot, {}, (self._cache, self._logits, one_cache, one_logits, np.int32(slot)),
            donate=(0, 1), sharding=self.engine._replicated)

    def _run_sample(self, decoding: np.ndarray):
        return self.engine._programs.run(
            "sample", _sample_step, {},
            (self._logits, decoding, self._eos, self._max_new, self._sampling, self._steps),
            sharding=self.engine._replicated)

    # ------------------------------------------------------------------------------------------ requests
    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or any(j is not None for j in self.running))

    @property
    def active(self) -> int:
        """Requests holding a slot (prefilling or decoding)."""
        return sum(self._reserved)

    def add(self, job: Job) -> None:
        """Queue a request (checked here: EngineInputError for one the engine cannot run)."""
        self.engine.check([job.request])
        job.segments = [int(n) for n in self.engine.segment_plan(len(job.request.prompt_ids))]
        self.waiting.append(job)

    def cancel(self, job_id: int) -> None:
        """Stop a request wherever it is; its slot is free for the next step."""
        for job in [*self.waiting, *self.prefilling, *self.running]:
            if job is not None and job.id == job_id:
                job.cancelled = True

    # ------------------------------------------------------------------------------------------ stepping
    def step(self) -> None:
        """One scheduling step: admit, one long-prefill segment, one decode step (module docstring)."""
        self._drop_cancelled()
        self._admit()
        if self.prefilling:
            self._prefill_segment()
        if any(j is not None for j in self.running):
            self._decode_step()

    def _drop_cancelled(self) -> None:
        for queue in (self.waiting, self.prefilling):
            for job in [j for j in queue if j.cancelled]:
                if queue is self.prefilling and job is queue[0]:
                    self._one = None  # only the head has prefill state
                queue.remove(job)
                if job.slot >= 0:
                    self._reserved[job.slot] = False
                job.sink("done", "cancelled")
        for b, job in enumerate(self.running):
            if job is not None and job.cancelled:
                self._free(b, "cancelled")

    def _admit(self) -> None:
        while self.waiting and not all(self._reserved):
            job = self.waiting.popleft()
            job.slot = self._reserved.index(False)
            self._reserved[job.slot] = True
            if max(job.segments) <= self.short_rows:
                self._join(job, self._run_init(1), jnp.zeros((1, self.engine.vocab_size), jnp.float32),
                           self.engine._empty_history(1))
            else:
                self.prefilling.append(job)

    def _join(self, job: Job, one_cache, one_logits, history) -> None:
        """``job`` takes its slot: the slot's cache row and logits become the one-row ones (its prefill, or a
        fresh cache for a short prompt that feeds in the decode steps), with its settings and step 0."""
        b, r = job.slot, job.request
        self._run_insert(one_cache, one_logits, b)
        if self._history is not None:
            self._history[b] = history[0]
        one = sampling_arrays([r.sampling])
        for name in ("temperature", "top_k", "top_p", "keys"):
            getattr(self._sampling, name)[b] = getattr(one, name)[0]
        self._max_new[b], self._steps[b] = r.max_new_tokens, 0
        self.running[b] = job

    def _prefill_segment(self) -> None:
        """The next segment of the head long prefill; after the last, the request joins its slot."""
        e, job = self.engine, self.prefilling[0]
        if self._one is None:
            self._one = (self._run_init(1), jnp.zeros((1, e.vocab_size), jnp.float32), e._empty_history(1))
        cache, logits, history = self._one
        size = job.segments.pop(0)
        # A short tail segment runs in the smallest long bucket (padding rows are ignored).
        ids = np.zeros((1, min(t for t in self._prefill_rows() if t >= size)), np.int32)
        ids[0, :size] = job.request.prompt_ids[job.prompt_done:job.prompt_done + size]
        cache, logits, _, history = e._forward(cache, ids, np.array([size], np.int32), logits, False, history)
        job.prompt_done += size
        self.prefill_calls += 1
        if job.segments:
            self._one = (cache, logits, history)
            return
        self._one = None
        self.prefilling.popleft()
        self._join(job, cache, logits, history)

    def _decode_step(self) -> None:
        """Sample every decoding slot's next token and report it; feed the ones that go on, and the next row of
        each short prompt still feeding."""
        ids = np.zeros(self.slots, np.int32)
        lengths = np.zeros(self.slots, np.int32)
        decoding = np.array([j is not None and j.prompt_done == len(j.request.prompt_ids) for j in self.running])
        if decoding.any():
            tokens, keep = self._run_sample(decoding)
            tokens, keep = np.asarray(tokens), np.asarray(keep)
            self.decode_steps += 1
            for b in np.flatnonzero(decoding):
                job, token = self.running[b], int(tokens[b])
                self._steps[b] += 1
                if token in self.engine.eos_ids:
                    self._free(b, "stop")
                    continue
                job.sink("token", token)
                if not keep[b]:
                    self._free(b, "length")
                elif not job.cancelled:
                    ids[b], lengths[b] = token, 1
        for b, job in enumerate(self.running):
            if job is not None and not decoding[b] and not job.cancelled:
                ids[b], lengths[b] = job.request.prompt_ids[job.prompt_done], 1
                job.prompt_done += 1
        if lengths.any():
            self._cache, self._logits, _, self._history = self.engine._forward(
                self._cache, ids[:, None], lengths, self._logits, False, self._history)

    def _free(self, b: int, reason: str) -> None:
        job = self.running[b]
        self.running[b] = None
        self._reserved[b] = False
        job.sink("done", reason)
