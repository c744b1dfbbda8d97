"""Prefill in segments, then decode: static shapes, each program compiled once per shape.

The model is split once (``nnx.split``) into a graph definition and a state pytree; the programs take the state
as an argument (a ``FlatState``: one flat tuple of arrays, cheap to flatten on every call) and ``merge`` it inside,
so weights are inputs, not constants baked into programs. Programs are compiled ahead of time
(``jit(...).lower(...).compile()``), all the shapes a request needs at once and in parallel, and kept in the
engine's ``ProgramTable`` (one per engine, built with it): each ``Program`` (name, function, donated and static
arguments) is compiled once per static arguments and input shapes, a shape seen
before never compiles again, and compile seconds are measured apart from run time.

The programs:

* ``step[B, T]``: the model over a segment of T rows (``ids [B, T]``, ``lengths [B]``), its head applied only to
  each sequence's last real row (every row of sequence 0 when recording logits), then sampling from those logits
  and the stop flags (an end id, the max new tokens), all in one program with the cache and the logits donated.
  Rows ``t >= lengths[b]`` are padding the model ignores (DESIGN.md "Model API"), which gives ragged batches and
  lets a segment run in a larger bucket. Its outputs include the next step's inputs (tokens as ``[B, 1]`` ids,
  ``lengths = keep_going``, the step index), so decode steps chain on the device without the host touching them.
  A batch of greedy requests runs its own variant that takes the argmax only (no sampling arrays,
  ``_stop_inputs``); any other sampling settings share one program.
* ``init[B]``: an empty cache.
* ``encode[images]`` (only for prompts with images): the vision tower and aligner over every image of the batch,
  padded to one size bucket, once per request (VISION.md §V.G). Its rows stay on device; each ``step`` call of
  such a request takes the table plus its segment's slice of row indices and roles (``ImageRows``), so spans may
  cross segment boundaries, and every step call of that request (decode included) uses the image signature,
  so one program per row count serves it.

Prefill cuts the batch's longest prompt into the planner's segments ``[start, start + n)``; sequence b
contributes ``clip(len_b - start, 0, n)`` real rows. A segment of more than ``short_rows`` rows runs as one
``step`` call whose T is n rounded up to a power-of-two bucket (so a handful of programs serve every prompt
length); a *short* segment (PLANNER.md §A: ≤ 16 rows) runs row by row through ``step[B, 1]`` — the decode
program — which saves a compile for short prompts. The prompt's last call draws the first new token. Decode is
one ``step[B, 1]`` call per token with ``lengths = keep_going``, so finished sequences' caches stay untouched;
the host dispatches step n+1 before it reads step n's tokens (printing lags a step), and without a streaming
callback keeps ``DECODE_AHEAD`` steps queued, so it waits on the device only to read tokens that are long done.
Steps queued past the last stop write nothing (lengths 0) and are dropped.

Engram (`MODEL.md` §B.12): for a model with engram layers every ``step`` call also takes the call's table
rows (``EngramInput``), hashed on the host just before the call (`dsv41_jax.engram.Hasher`) from the call's ids
and each sequence's last three ids. That history lives here, in the engine, per ``generate`` call (numpy
``[B, 3]``), not in the device cache: the ids of every segment and every sampled token pass through the host
(an engram model's decode reads each step's tokens before it dispatches the next), the hash needs the host,
and the device program stays free of host-only state; segments and decode steps then hash exactly as one pass
(tests/test_engram_parity.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import math
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import compiler
from .config import ModelConfig
from .planner import SHORT_ROWS, segment_sizes
from .sampling import SamplingArrays, SamplingParams, sample, sampling_arrays

DECODE_AHEAD = 4  # decode steps queued on the device while the host reads a token (no streaming callback)


class EngineInputError(ValueError):
    """A request the engine cannot run (empty prompt, too long, ids outside the vocabulary, ...)."""


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


# ------------------------------------------------------------------------------------------------ programs
def image_rows(images):
    """A segment's ``(table [R, D], row [B,T] i32 (−1: none), roles [B,T] i32)`` (`segment_images`) as the model's
    ``ImageRows`` (inside a program)."""
    from .model.transformer import ImageRows  # noqa: PLC0415

    table, row, roles = images
    return ImageRows(jnp.take(table, jnp.maximum(row, 0), axis=0), roles)


@jax.tree_util.register_pytree_node_class
class FlatState:
    """The model's state (``nnx.split``) as a flat tuple of arrays and the state's tree definition: what the
    engine passes its programs. A call flattens its arguments every time, and an ``nnx.State`` flattens in Python
    one Variable at a time: a call with the 2-layer cut's state (64 arrays) took 178 µs on the H200 machine's
    host, 94 µs with a FlatState (docs/BENCHMARKS.md, issue 14, 2026-12-02); the decode loop pays it per token."""

    def __init__(self, leaves: tuple, treedef):
        self.leaves, self.treedef = leaves, treedef

    @classmethod
    def of(cls, state) -> "FlatState":
        leaves, treedef = jax.tree.flatten(state)
        return cls(tuple(leaves), treedef)

    def state(self):
        """The ``nnx.State`` again (inside a program: of tracers)."""
        return jax.tree.unflatten(self.treedef, self.leaves)

    def tree_flatten(self):
        return self.leaves, self.treedef

    @classmethod
    def tree_unflatten(cls, treedef, leaves):
        return cls(tuple(leaves), treedef)


def all_greedy(requests) -> bool:
    """Whether every request is greedy: such a batch runs the argmax-only step programs (``Engine._stop_inputs``)."""
    return all(r.sampling.greedy for r in requests)


def merge(graphdef, state: FlatState) -> nnx.Module:
    """The model of a program's ``graphdef`` and ``FlatState`` argument."""
    return nnx.merge(graphdef, state.state())


def _forward(graphdef, state, cache, ids, lengths, last_logits, images, engram, keep_first_row: bool):
    """The model part of ``_step``.

    ids [B,T] i32, lengths [B] i32, last_logits [B,V] f32, engram rows (EngramInput | None) ->
    (cache, last_logits, first [T,V] f32 | None).

    ``last_logits[b]`` becomes the logits of row ``lengths[b] - 1`` wherever ``lengths[b] > 0``; after a prompt's
    last segment it holds the logits of the prompt's last row, after a decode step those of the fed token.
    ``images``: None (text) or (table [R, D] encoded image rows, row [B,T] i32 (−1: none), roles [B,T] i32):
    the segment's slice of the request's image positions (VISION.md §V.E.6).
    """
    model = merge(graphdef, state)
    kwargs = {} if engram is None else {"engram": engram}
    if images is not None:
        kwargs["images"] = image_rows(images)
    last_row = jnp.clip(lengths - 1, 0, ids.shape[1] - 1)
    if keep_first_row:  # every row of sequence 0 is recorded: the head runs on every row
        logits, cache = model(ids, cache, lengths=lengths, **kwargs)
        logits = logits.astype(jnp.float32)
        row_logits = jnp.take_along_axis(logits, last_row[:, None, None], axis=1)[:, 0]
    else:  # the head runs on each sequence's last real row only (issue #22)
        row_logits, cache = model(ids, cache, lengths=lengths, logit_rows=last_row, **kwargs)
        row_logits = row_logits.astype(jnp.float32)
    last_logits = jnp.where((lengths > 0)[:, None], row_logits, last_logits)
    return cache, last_logits, (logits[0] if keep_first_row else None)


def _encode_images(graphdef, state, batch):
    """``vision.batch.ImageBatch`` -> aligner rows [B_img, M, D] (VISION.md §V.C–§V.D), once per request."""
    return merge(graphdef, state).encode_images(batch)


def keeps_going(running, tokens, eos_ids, step, max_new):
    """Whether each sequence goes on after drawing ``tokens`` [B] as its token number ``step`` (scalar or [B]): it
    was running, the token is no end id (``eos_ids`` [E]) and not its ``max_new`` [B]-th -> bool [B]. The step
    program computes it on the device (jnp arrays) to chain steps; the host loop computes the same from the
    tokens it reads (numpy arrays), so it never reads the device's flags back (one transfer a step, not two)."""
    return running & ~(tokens[:, None] == eos_ids[None, :]).any(axis=-1) & (step + 1 < max_new)


class StepOut(NamedTuple):
    """What ``_step`` returns. The last four are the next decode step's ``ids``, ``lengths``, ``running`` and
    ``step`` as they are: the host chains steps without reading them (or changing their shapes) first."""

    cache: object
    last_logits: jax.Array  # [B,V] f32
    first: jax.Array | None  # [T,V] f32 (sequence 0's rows, only when recording)
    tokens: jax.Array  # [B,1] i32: the token each sequence drew from last_logits
    lengths: jax.Array  # [B] i32: 1 where the sequence keeps going, else 0
    keep_going: jax.Array  # [B] bool
    next_step: jax.Array  # i32 scalar


def _step(graphdef, state, cache, ids, lengths, last_logits, running, step, eos_ids, max_new,
          sampling: SamplingArrays, images, engram, keep_first_row: bool) -> StepOut:
    """One forward call and the sampling after it, as one program (prefill segments and decode steps alike).

    ids [B,T] i32, lengths [B] i32, last_logits [B,V] f32 (see ``_forward``), running [B] bool, step i32 (the
    index of the token drawn now: a scalar, or [B] when each sequence counts its own, as the server's slots do),
    eos_ids [E] i32, max_new [B] i32. Every sequence draws a token from its ``last_logits``; it keeps going unless
    that token is an end id or its ``max_new``-th. The host uses the tokens of a prompt's last call and of decode
    steps; earlier prefill calls' draws are don't-care (cheap: [B,V]).
    """
    cache, last_logits, first = _forward(graphdef, state, cache, ids, lengths, last_logits, images, engram,
                                         keep_first_row)
    tokens = sample(last_logits, sampling, step)
    keep_going = keeps_going(running, tokens, eos_ids, step, max_new)
    return StepOut(cache, last_logits, first, tokens[:, None], keep_going.astype(jnp.int32), keep_going,
                   step + 1)


class Chunk(NamedTuple):
    """What ``_steps`` returns: ``last``, the last step's ``StepOut`` (the next call chains on it as on a step's);
    ``tokens`` [B, k] i32, the token of each of the k steps (whether a sequence went on after each, the host
    derives from them: `keeps_going`)."""

    last: StepOut
    tokens: jax.Array


def _steps(graphdef, state, cache, ids, lengths, last_logits, running, step, eos_ids, max_new,
           sampling: SamplingArrays, images, engram, keep_first_row: bool, k: int) -> Chunk:
    """``k`` decode steps in one program (``Engine(decode_chunk=k)``): ``_step`` under a ``lax.scan`` whose carry is
    what one step hands the next (cache, logits, tokens as ids, lengths, running, step), so the host dispatches and
    reads once per k tokens. Sequences that stop inside the chunk feed lengths 0 afterwards (no cache writes), as
    queued single steps do. Decode only: no engram rows (hashed on the host per step), no recorded rows."""
    if engram is not None or keep_first_row:
        raise ValueError("a decode chunk takes no engram rows and records no logits")

    def one(carry, _):
        cache, logits, ids, lengths, running, step = carry
        out = _step(graphdef, state, cache, ids, lengths, logits, running, step, eos_ids, max_new, sampling,
                    images, None, False)
        return ((out.cache, out.last_logits, out.tokens, out.lengths, out.keep_going, out.next_step),
                out.tokens[:, 0])

    carry, tokens = jax.lax.scan(one, (cache, last_logits, ids, lengths, running, step), length=k)
    cache, logits, ids, lengths, running, step = carry
    return Chunk(StepOut(cache, logits, None, ids, lengths, running, step), tokens.T)


class StepTiming(NamedTuple):
    """``Engine.step_seconds``: seconds per step, the cache after the steps, the compiled step program."""

    seconds: float
    cache: object
    program: object


def _fresh_cache(*, init, cfg, batch, max_context, dtype, sharding):
    """An empty cache made by a program, so every leaf is its own buffer (donation needs that); replicated over
    the mesh when ``sharding`` is given (caches are replicated, `MODEL.md` §F.1)."""
    cache = init(cfg, batch, max_context, dtype)
    return cache if sharding is None else jax.lax.with_sharding_constraint(cache, sharding)


def _abstract(tree, sharding=None):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=sharding), tree)


# ------------------------------------------------------------------------------------------- program table
@dataclass(frozen=True)
class Program:
    """A program of the engine's table: ``fn`` jitted with the arguments named in ``static`` static and the
    positions in ``donate`` donated. ``model``: ``fn(graphdef, state, ...)`` runs the model; the table binds the
    graph definition, the caller passes the state first, and the state is left out of the key (it is the same
    for the engine's lifetime)."""

    name: str
    fn: Callable
    donate: tuple[int, ...] = ()
    static: tuple[str, ...] = ()
    model: bool = True


# The engine's programs. ``step`` serves prefill segments (one per program row count T) and the decode step
# (T = 1); ``steps`` is the decode chunk (k steps under a lax.scan); the cache and last_logits are donated.
INIT = Program("init", _fresh_cache, static=("init", "cfg", "batch", "max_context", "dtype", "sharding"), model=False)
STEP = Program("step", _step, donate=(1, 4), static=("keep_first_row",))
STEPS = Program("steps", _steps, donate=(1, 4), static=("keep_first_row", "k"))
ENCODE = Program("encode", _encode_images)


class Call(NamedTuple):
    """One entry to compile: the program, its static arguments, its arguments (abstract or real)."""

    program: Program
    static: dict
    args: tuple


class ProgramTable:
    """The compiled programs of one engine, keyed by (program name, static arguments, input shapes); times every
    compile. ``compiled``: key → executable (key[0] is the program's name)."""

    def __init__(self, graphdef):
        self.graphdef = graphdef
        self.compiled: dict = {}
        self.compile_s = 0.0
        self.loaded = 0  # programs whose executable came from the persistent cache
        self._graph_digest = compiler.graph_digest(graphdef)  # names the model programs in `compiler`'s store

    @staticmethod
    def key(call: Call) -> tuple:
        args = call.args[1:] if call.program.model else call.args
        leaves, treedef = jax.tree.flatten(_abstract(args))
        return (call.program.name, tuple(sorted(call.static.items())), treedef,
                tuple((x.shape, str(x.dtype)) for x in leaves))

    def _compile(self, call: Call):
        program = call.program
        fn = functools.partial(program.fn, self.graphdef) if program.model else program.fn
        jitted = jax.jit(fn, static_argnames=program.static, donate_argnums=program.donate)
        return compiler.compile(jitted, call.args, call.static, identity=self._identity(program))  # (exe, loaded)

    def _identity(self, program: Program) -> str:
        """What names ``program`` across processes beyond its arguments (`compiler.compile`'s store key)."""
        return (f"{program.fn.__module__}.{program.fn.__qualname__} donate={program.donate} "
                f"graph={self._graph_digest if program.model else None}")

    def ensure(self, calls: Sequence[Call]) -> None:
        """Compile every call not compiled yet, in parallel threads."""
        todo = {}
        for call in calls:
            key = self.key(call)
            if key not in self.compiled:
                todo.setdefault(key, call)
        if not todo:
            return
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(todo)) as pool:
            futures = {key: pool.submit(self._compile, call) for key, call in todo.items()}
            for key, fut in futures.items():
                self.compiled[key], loaded = fut.result()
                self.loaded += loaded
        self.compile_s += time.perf_counter() - start

    def get(self, program: Program, static: dict, args: tuple, sharding=None):
        """The executable for these arguments (placed with ``sharding``), compiled first if their shapes are new."""
        head, rest = (args[:1], args[1:]) if program.model else ((), args)
        call = Call(program, static, (*head, *_abstract(rest, sharding)))
        key = self.key(call)
        if key not in self.compiled:
            self.ensure([call])
        return self.compiled[key]

    def run(self, program: Program, static: dict, args: tuple, sharding=None):
        """Call the program on these arguments, compiling it first if their shapes are new."""
        return self.get(program, static, args, sharding)(*args)


class Engine:
    """Runs batches of requests through one model. ``max_context``: cache capacity per sequence (positions).

    ``segment_plan(longest prompt) -> sizes`` (default: the planner's, ``planned_segments``); segments of at most
    ``short_rows`` rows run row by row through the decode program (0: never). ``hasher``: the engram hasher
    (`dsv41_jax.engram.Hasher`, e.g. with a checkpoint's token map) when the model runs engram layers; default
    ``Hasher(cfg)``. ``host_tables``: `dsv41_jax.engram.HostTables` for a model built with
    ``ModelOptions(engram_tables="host")``: each call's rows are gathered on the host and sent with it.
    """

    def __init__(self, model: nnx.Module, cfg: ModelConfig, *, max_context: int, cache_dtype: str = "bfloat16",
                 eos_ids: Sequence[int] | None = None, segment_plan: SegmentPlan | None = None,
                 short_rows: int = SHORT_ROWS, init_cache: Callable | None = None, mesh=None,
                 hasher=None, host_tables=None, decode_chunk: int = 1):
        if decode_chunk < 1:
            raise ValueError(f"decode_chunk must be at least 1, got {decode_chunk}")
        if init_cache is None:
            from .model.cache import init_cache  # noqa: PLC0415 - keeps `import engine` light
        self.cfg = cfg
        self.vocab_size = int(getattr(model, "vocab_size", cfg.vocab_size))
        self.max_context = int(max_context)
        self.cache_dtype = cache_dtype
        self.eos_ids = tuple(eos_ids if eos_ids is not None else cfg.eos_token_ids)
        self.segment_plan = segment_plan or planned_segments(cfg, 1 if mesh is None else mesh.size)
        self.short_rows = short_rows
        self._init_cache = init_cache
        # With a mesh (a sharded model) every input but the weights is replicated over it.
        self._replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.hasher = None
        if getattr(model, "engram_layers", ()):
            from .engram import Hasher  # noqa: PLC0415

            self.hasher = hasher or Hasher(cfg)
        self._has_vision = hasattr(model, "vision")  # built with the image path (a sharded model's: its inner's)
        self.host_tables = host_tables  # engram tables on the host (`engram.HostTables`): rows gathered per call
        # decode steps per program call (`_steps`); 1 = one `step[B, 1]` call per token. Engram models and recorded
        # runs decode one step at a time whatever this says.
        self.decode_chunk = int(decode_chunk)
        graphdef, state = nnx.split(model)
        self.state = FlatState.of(state)  # every program's first argument
        self._programs = ProgramTable(graphdef)  # built once per engine

    def check(self, requests: Sequence[Request]) -> None:
        """Raise EngineInputError for a request the engine cannot run."""
        check_requests(requests, self.vocab_size, self.max_context)

    # ------------------------------------------------------------------------------------------ compiling
    @property
    def compile_count(self) -> int:
        """Programs compiled so far by this engine (one per program, static arguments and input shapes)."""
        return len(self._programs.compiled)

    @property
    def programs_loaded(self) -> int:
        """Of ``compile_count``, the programs loaded whole from the persistent cache (no trace, no compile)."""
        return self._programs.loaded

    def _plan(self, requests) -> tuple[list[int], list[int]]:
        """(segment sizes, program rows per segment: 1 for short segments, else the bucket)."""
        total = max(len(r.prompt_ids) for r in requests)
        sizes = [int(n) for n in self.segment_plan(total)]
        if sum(sizes) != total or min(sizes) < 1:
            raise EngineInputError(f"segment plan {sizes} does not cover the {total}-token prompt")
        cap = max(sizes)
        rows = [1 if n <= self.short_rows else bucket_rows(n, cap) for n in sizes]
        return sizes, rows

    def _specs(self, batch: int, program_rows: Sequence[int], record: bool, images: bool = False,
               slot_steps: bool = False, greedy: bool = False) -> list[Call]:
        """Everything a batch of ``batch`` with these prefill program sizes runs (``images``: the forward
        programs take image rows, whose shapes are known after encoding: they compile on first use;
        ``slot_steps``: the step index is [batch], one count per sequence, as `serve.slots` runs it; ``greedy``:
        every request is greedy, so the steps take no sampling arrays, ``_stop_inputs``)."""
        cache = _abstract(jax.eval_shape(lambda: self._init_cache(self.cfg, batch, self.max_context,
                                                                  self.cache_dtype)), self._replicated)

        def arg(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self._replicated)

        i32 = jnp.int32
        logits, vec = arg((batch, self.vocab_size), jnp.float32), arg((batch,), i32)
        sampling = None if greedy else _abstract(sampling_arrays([SamplingParams()] * batch), self._replicated)
        step = arg((batch,) if slot_steps else (), i32)
        stop = (arg((batch,), jnp.bool_), step, arg(self.stop_ids().shape, i32), vec, sampling)
        specs = [Call(INIT, self._init_static(batch), ())]
        for t in sorted({1, *program_rows}) if not images else ():
            ids = arg((batch, t), i32)
            specs.append(Call(STEP, {"keep_first_row": record},
                              (self.state, cache, ids, vec, logits, *stop, None, self._engram_abstract(batch, t, arg))))
        if self.decode_chunk > 1 and self.hasher is None and not record and not slot_steps and not images:
            specs.append(Call(STEPS, {"keep_first_row": False, "k": self.decode_chunk},
                              (self.state, cache, arg((batch, 1), i32), vec, logits, *stop, None, None)))
        return specs

    def _engram_abstract(self, batch, t, arg):
        if self.hasher is None:
            return None
        from .model.engram import EngramInput  # noqa: PLC0415

        lay = self.hasher.layout
        shape = (batch, t, len(lay.layer_ids), lay.columns)
        gathered = None
        if self.host_tables is not None:
            gathered = arg((*shape, self.host_tables.row_bytes), jnp.uint8)
        return EngramInput(rows=arg(shape, jnp.int32), text=arg((batch, t), jnp.bool_), gathered=gathered)

    def _engram_rows(self, ids: np.ndarray, lengths: np.ndarray, history, images=None):
        """(EngramInput for this call | None, the history after it): hashed on the host (module docstring).
        ``images``: the call's slice of the image positions (`segment_images`) or None; image-span positions are
        DEAD in the hash history and gated to 0 (VISION.md §V.E.4)."""
        if self.hasher is None:
            return None, history
        from .model.engram import EngramInput  # noqa: PLC0415

        is_image = None if images is None else np.asarray(images[2]) >= 0

        rows, history = self.hasher.rows(ids, history, is_image=is_image, lengths=lengths)
        text = np.ones(ids.shape, bool) if is_image is None else ~is_image
        # Host tables: the rows as stored, gathered now; the device step dispatched before this call is still
        # running (async dispatch), so a prefill's gathers overlap the previous segment (engram.HostTables).
        gathered = None if self.host_tables is None else self.host_tables.gather(rows)
        return EngramInput(rows=rows.astype(np.int32), text=text, gathered=gathered), history

    def _empty_history(self, batch: int):
        if self.hasher is None:
            return None
        from .engram import empty_history  # noqa: PLC0415

        return empty_history(self.cfg, batch)

    def _init_static(self, batch: int) -> dict:
        return {"init": self._init_cache, "cfg": self.cfg, "batch": batch, "max_context": self.max_context,
                "dtype": self.cache_dtype, "sharding": self._replicated}

    def precompile(self, batch: int, prompt_len: int, record_logits: bool = False, images: bool = False,
                   greedy: bool = False) -> float:
        """Compile what a batch of ``batch`` prompts of up to ``prompt_len`` tokens needs; returns seconds.
        ``images``: the prompts have images, whose prefill programs compile on first use (decode only here);
        ``greedy``: every request will be greedy (its steps are programs of their own, ``_stop_inputs``)."""
        before = self._programs.compile_s
        _, rows = self._plan([Request((0,) * prompt_len)])
        self._programs.ensure(self._specs(batch, rows, record_logits, images, greedy=greedy))
        return self._programs.compile_s - before

    # ------------------------------------------------------------------------------------------ running
    def generate(self, requests: Sequence[Request], *, on_tokens: TokenCallback | None = None,
                 on_prefill: ProgressCallback | None = None, record_logits: bool = False) -> GenerateResult:
        """Prefill every request's prompt, then decode until each hits an end id or its max new tokens."""
        self.check(requests)
        sizes, rows = self._plan(requests)
        timings = Timings(prompt_tokens=sum(len(r.prompt_ids) for r in requests), segments=tuple(sizes))
        compile_before, count_before, loaded_before = self._programs.compile_s, self.compile_count, self.programs_loaded
        has_images = any(r.images is not None for r in requests)
        greedy = all_greedy(requests)
        self._programs.ensure(self._specs(len(requests), rows, record_logits, has_images, greedy=greedy))
        cache = self._programs.run(INIT, self._init_static(len(requests)), ())
        images = self._encode(requests)
        stop = self._stop_inputs(requests, greedy=greedy)
        out, prefill_logits, history = self._prefill(requests, cache, stop, sizes, rows, timings, on_prefill,
                                                     record_logits, images)
        step_images = segment_images(images, 0, 0, 1)
        if step_images is not None:  # the same every decode step: placed once
            step_images = jax.device_put(step_images, self._replicated)
        first_row = prefill_logits[-1:] if record_logits else None  # token 0's distribution
        generations, decode_logits = self._decode(requests, out, first_row, stop, timings, on_tokens,
                                                  record_logits, history, step_images)
        timings.compile_s = self._programs.compile_s - compile_before
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
        stop = self._stop_inputs(requests, greedy=all_greedy(requests))
        timings = Timings()
        compiled_before, t0 = self._programs.compile_s, time.perf_counter()
        out = self._call(False, self._step_args(None, cache, np.asarray(last_ids, np.int32).reshape(batch, 1),
                                                np.ones(batch, np.int32), np.zeros((batch, self.vocab_size),
                                                                                   np.float32),
                                                np.ones(batch, bool), np.int32(0), stop, None)[0])
        generations, _ = self._decode(requests, out, None, stop, timings, on_tokens, False, None)
        timings.decode_s = time.perf_counter() - t0 - (self._programs.compile_s - compiled_before)
        return GenerateResult(generations, timings)

    def step_seconds(self, cache, last_ids, steps: int, sampling: SamplingParams | None = None) -> StepTiming:
        """``steps`` calls of the one-row step program chained on the device (each feeding the previous step's
        tokens), nothing read back, one wait at the end, after one warm-up call: the device-bound rate that
        ``generate``'s host loop is measured against. ``cache`` is donated and must hold ``steps + 1`` more
        positions. ``sampling``: every sequence's settings (default greedy: the argmax-only step program)."""
        batch = len(last_ids)
        requests = [Request((0,), steps + 2, sampling or SamplingParams())] * batch  # nobody stops by length
        stop = self._stop_inputs(requests, greedy=all_greedy(requests))
        args, _ = self._step_args(None, cache, np.asarray(last_ids, np.int32).reshape(batch, 1),
                                  np.ones(batch, np.int32), np.zeros((batch, self.vocab_size), np.float32),
                                  np.ones(batch, bool), np.int32(0), stop, None)
        run = self._programs.get(STEP, {"keep_first_row": False}, args, self._replicated)
        out = run(*args)
        jax.block_until_ready(out.tokens)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = run(self.state, out.cache, out.tokens, out.lengths, out.last_logits, out.keep_going,
                      out.next_step, *stop, None, None)
        jax.block_until_ready(out.tokens)
        return StepTiming((time.perf_counter() - t0) / steps, out.cache, run)

    def stop_ids(self) -> np.ndarray:
        """The end ids as the step program and the host loops take them: int32 [E], (-1,) when there are none
        (no token is −1)."""
        return np.array(self.eos_ids or (-1,), np.int32)

    def _stop_constants(self, requests) -> tuple[np.ndarray, np.ndarray]:
        """(end ids [E], max new tokens [B]) on the host: the stop rule's constants (`keeps_going`)."""
        return self.stop_ids(), np.array([r.max_new_tokens for r in requests], np.int32)

    def _stop_inputs(self, requests, greedy: bool = False) -> tuple:
        """(eos ids [E], max new tokens [B], SamplingArrays | None): the step program's per-request constants,
        placed on the device once per ``generate``. ``greedy`` (the caller's ``all_greedy(requests)``): None
        instead of the arrays; the step is then a program of its own that takes the argmax and nothing else (the
        sampling path sorts the vocabulary every step: `sampling.sample`)."""
        eos, max_new = self._stop_constants(requests)
        sampling = None if greedy else sampling_arrays([r.sampling for r in requests])
        return jax.device_put((eos, max_new, sampling), self._replicated)

    def _step_args(self, out: StepOut | None, cache, ids, lengths, logits, running, step, stop, history,
                   images=None):
        """The arguments of one ``step`` call and the engram history after it. ``ids``/``lengths``/``running``/
        ``step`` are host arrays (prefill, engram decode) or the previous step's device outputs (chained decode);
        engram rows are hashed from host ids here (module docstring)."""
        engram, history = self._engram_rows(ids, lengths, history, images)
        if out is not None:
            cache, logits = out.cache, out.last_logits
        return (self.state, cache, ids, lengths, logits, running, step, *stop, images, engram), history

    def _call(self, record: bool, args) -> StepOut:
        return self._programs.run(STEP, {"keep_first_row": record}, args, self._replicated)

    def _encode(self, requests):
        """Encode every image of the batch once (one tower call, VISION.md §V.G) -> None (no images) or
        (table [R, D] on device, row [B, T_max] i32 host, roles [B, T_max] i32 host) for `_prefill`."""
        if all(r.images is None or not r.images.images for r in requests):
            return None
        vc = self.cfg.vision
        if vc is None or not self._has_vision:
            raise EngineInputError("this model has no vision tower: image prompts need a checkpoint with a "
                                   "vision_config, loaded with its image path")
        from .vision.batch import build_batch, image_row_index  # noqa: PLC0415

        total = max(len(r.prompt_ids) for r in requests)
        row = np.full((len(requests), total), -1, np.int32)
        roles = np.full((len(requests), total), -1, np.int32)
        images = [im for r in requests if r.images is not None for im in r.images.images]
        batch = build_batch(images, vc)
        m = batch.gather.shape[1]
        first = 0
        for b, r in enumerate(requests):
            if r.images is None:
                continue
            n = len(r.images.images)
            row[b, : len(r.prompt_ids)] = image_row_index(r.images.roles, [(first + k) * m for k in range(n)],
                                                          r.images.starts)
            roles[b, : len(r.prompt_ids)] = r.images.roles
            first += n
        encoded = self._programs.run(ENCODE, {}, (self.state, batch), self._replicated)
        return encoded.reshape(-1, encoded.shape[-1]), row, roles

    def _prefill(self, requests, cache, stop, sizes, rows, timings: Timings, on_prefill, record, images=None):
        """Run the prompts' segments -> (the last call's StepOut, whose tokens are every sequence's first new
        token, prefill logits of request 0 [len, V] | None, engram history)."""
        batch = len(requests)
        lengths = np.array([len(r.prompt_ids) for r in requests], np.int32)
        total = int(lengths.max())
        padded = np.zeros((batch, total), np.int32)
        for b, r in enumerate(requests):
            padded[b, : lengths[b]] = r.prompt_ids
        logits = np.zeros((batch, self.vocab_size), np.float32)
        running, step0 = np.ones(batch, bool), np.int32(0)
        first_rows = []
        start = 0
        history = self._empty_history(batch)
        out = None
        compiled_before, t0 = self._programs.compile_s, time.perf_counter()  # first-use compiles: not prefill time
        for size, t in zip(sizes, rows):
            # A short segment runs as `size` one-row calls; a long one as one call of `t >= size` rows.
            for sub_start, sub_size in [(start + i, 1) for i in range(size)] if t == 1 else [(start, size)]:
                ids = np.zeros((batch, t), np.int32)
                ids[:, :sub_size] = padded[:, sub_start : sub_start + sub_size]
                sub_lengths = np.clip(lengths - sub_start, 0, sub_size).astype(np.int32)
                args, history = self._step_args(out, cache, ids, sub_lengths, logits, running, step0, stop, history,
                                                segment_images(images, sub_start, sub_size, t))
                out = self._call(record, args)
                if record:
                    first_rows.append(np.asarray(out.first)[: min(sub_size, max(0, int(lengths[0]) - sub_start))])
            start += size
            if on_prefill:
                jax.block_until_ready(out.last_logits)
                on_prefill(start, total)
        jax.block_until_ready(out.tokens)
        timings.prefill_s = time.perf_counter() - t0 - (self._programs.compile_s - compiled_before)
        return out, (np.concatenate(first_rows, axis=0) if record else None), history

    def _decode(self, requests, out: StepOut, first_row, stop, timings: Timings, on_tokens, record, history,
                images=None):
        """Read token 0 from the prefill's last call, then run one ``step`` program per token (or one ``steps``
        program per ``decode_chunk`` tokens).

        Without engram layers the host chains each call on the previous call's device outputs and keeps up to
        ``ahead`` calls queued while it reads tokens: one call (printing lags a call) with a streaming callback,
        ``DECODE_AHEAD`` steps (two chunks) without. Steps queued past the last stop do no cache writes (their lengths are 0) and
        are dropped. Engram models hash each step's ids on the host first: one step at a time."""
        batch = len(requests)
        longest = max(r.max_new_tokens for r in requests)
        chunk = self.decode_chunk if self.hasher is None and not record else 1
        if self.hasher is not None:
            ahead = 0
        else:  # calls kept queued: a chunk call already holds `chunk` tokens
            ahead = 1 if on_tokens else (DECODE_AHEAD if chunk == 1 else 2)
        pending = collections.deque([(out.tokens, first_row)])  # oldest first
        eos, max_new = self._stop_constants(requests)
        dispatched = 1  # token indices dispatched so far
        alive = np.ones(batch, bool)  # sequences producing the token read next
        produced: list[list[int]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        recorded = []
        step = 0
        run = None  # the compiled decode program, looked up once

        def dispatch(ids, lengths, running, index):
            nonlocal out, history, run, dispatched
            args, history = self._step_args(out, None, ids, lengths, None, running, index, stop, history, images)
            program, static = (STEP, {"keep_first_row": record}) if chunk == 1 else (
                STEPS, {"keep_first_row": False, "k": chunk})
            if run is None:
                run = self._programs.get(program, static, args, self._replicated)
            result = run(*args)
            if chunk == 1:
                out = result
                pending.append((out.tokens, out.first))
            else:
                out = result.last
                pending.append((result.tokens, None))
            pending[-1][0].copy_to_host_async()  # the host reads it next: the copy starts when it is ready
            dispatched += chunk

        compiled_before, t0 = self._programs.compile_s, time.perf_counter()  # first-use compiles: not decode time
        while pending:
            while ahead and len(pending) <= ahead and dispatched < longest:
                dispatch(out.tokens, out.lengths, out.keep_going, out.next_step)
            tokens, first = pending.popleft()
            tokens_np = np.asarray(tokens).reshape(batch, -1)
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
        timings.decode_s = time.perf_counter() - t0 - (self._programs.compile_s - compiled_before)
        timings.decode_steps = step
        timings.generated_tokens = sum(len(p) for p in produced)
        generations = [Generation(tuple(r.prompt_ids), tuple(p), f) for r, p, f in zip(requests, produced, finish)]
        return generations, (np.stack(recorded) if record else None)


def segment_images(images, start: int, size: int, rows: int):
    """The slice [start, start + size) of `Engine._encode`'s per-position arrays, padded to ``rows`` rows (None
    when the batch has no images). A slice without span positions still goes this way (all TEXT), so one
    program per row count serves a request with images, decode steps included."""
    if images is None:
        return None
    table, row, roles = images
    seg_row = np.full((row.shape[0], rows), -1, np.int32)
    seg_roles = np.full((row.shape[0], rows), -1, np.int32)
    seg_row[:, :size], seg_roles[:, :size] = row[:, start:start + size], roles[:, start:start + size]
    return table, seg_row, seg_roles

