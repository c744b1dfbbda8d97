"""One step (prefill or decode) compiled with its shardings, XLA's analyses of it, and timed runs.

A step is the engine's model program: ``logits, cache = model(ids, cache, lengths)`` and the last row's logits
kept (what ``engine`` compiles for a segment; a decode step is the same program on one row, followed by greedy
sampling of the next token). It is compiled ahead of time with explicit in/out shardings (weights by the rule
table, caches and small inputs replicated: ``sharding.prepare``'s contract). A prefill step's cache is not
donated, so each repeat runs from the same input cache at the same position (the same work every time) and pays
for a fresh cache copy (small next to a segment's work). A decode step donates its cache, as the engine's step
does, and each run takes the cache the previous one returned (one position further: the same work ± one entry);
without donation a decode step at 300 K would also copy the whole cache, ~0.25 ms of a ~1.5 ms step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import compiler
from dsv41_jax.profiling.trace import instruction_sources
from dsv41_jax.runtime import FlatState, merge
from sharding import replicated


@dataclass
class StepResult:
    """What one compiled step showed. Bytes and FLOPs are per device (XLA's SPMD program is per device)."""

    kind: str  # "prefill" | "decode"
    rows: int
    position: int
    batch: int
    compile_s: float = 0.0
    loaded: bool = False  # the executable came from the persistent cache (no trace, no compile)
    xla_flops: float | None = None
    xla_bytes_accessed: float | None = None
    memory: dict[str, int] = field(default_factory=dict)  # argument / output / alias / temp / code bytes
    times_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.times_s) if self.times_s else None

    @property
    def tokens_per_s(self) -> float | None:
        m = self.median_s
        return self.batch * self.rows / m if m else None


@dataclass
class Step:
    """A compiled step and its arguments, ready to run."""

    result: StepResult
    compiled: object
    args: tuple
    chained: bool = False  # the cache (argument 1) is donated: each run feeds the next the cache it returned

    def run(self):
        out = self.compiled(*self.args)
        if self.chained:
            self.args = (self.args[0], out[0], *self.args[2:])
        jax.block_until_ready(out)
        return out


def prefill_step(model, cache, *, rows: int, position: int, seed: int = 2, hasher=None) -> Step:
    """The prefill step over ``rows`` random token ids per sequence, at the cache's offset ``position``.
    ``hasher`` (`dsv41_jax.engram.Hasher`, for a model with engram layers): the step takes the rows it hashes
    for those ids, as the engine feeds them."""
    return _model_step(model, cache, rows, position, "prefill", seed, hasher)


def decode_step(model, cache, *, position: int, seed: int = 3, hasher=None, donate: bool = True) -> Step:
    """The decode step: one row per sequence at the cache's offset, then the greedy next token. ``donate``: the
    step consumes ``cache`` (each run continues from the last; the cache needs a free row per run)."""
    return _model_step(model, cache, 1, position, "decode", seed, hasher, donate)


def _model_step(model, cache, rows: int, position: int, kind: str, seed: int, hasher, donate: bool = False) -> Step:
    graphdef, state = nnx.split(model)
    state = FlatState.of(state)  # as the engine passes it: a call's host cost as the engine's
    rep = replicated(model.mesh)
    batch, vocab = cache.offset.shape[0], model.vocab_size
    ids_host = np.random.default_rng(seed).integers(0, vocab, (batch, rows), dtype=np.int32)
    ids = jax.device_put(ids_host, rep)
    lengths = jax.device_put(np.full((batch,), rows, np.int32), rep)
    engram = None if hasher is None else jax.device_put(_engram_input(hasher, ids_host), rep)

    def step(state, cache, ids, lengths, engram):
        """-> (cache, last-row logits [B, V] f32, greedy next token [B] i32)."""
        kwargs = {} if engram is None else {"engram": engram}
        # the head on each sequence's last row only, as the engine's step runs it
        last, cache = merge(graphdef, state)(ids, cache, lengths=lengths, logit_rows=lengths - 1, **kwargs)
        last = last.astype(jnp.float32)
        return cache, last, jnp.argmax(last, axis=-1).astype(jnp.int32)

    cache_sh = jax.tree.map(lambda _: rep, cache)
    args = (state, cache, ids, lengths, engram)
    result = StepResult(kind, rows, position, batch)
    try:
        compiled = _compile(step, (_shardings(state), cache_sh, rep, rep, jax.tree.map(lambda _: rep, engram)),
                            (cache_sh, rep, rep), args, result, graphdef, donate=(1,) if donate else ())
    except Exception as e:  # noqa: BLE001 - a step that does not compile is reported, the others still run
        result.error = f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        compiled = None
    return Step(result, compiled, args, chained=donate)


def _engram_input(hasher, ids: np.ndarray):
    """The EngramInput the engine would feed for ``ids`` [B, T] at the start of a sequence (empty history)."""
    from dsv41_jax import engram  # noqa: PLC0415
    from dsv41_jax.model.engram import EngramInput  # noqa: PLC0415

    rows, _ = hasher.rows(ids, engram.empty_history(hasher.cfg, ids.shape[0]))
    return EngramInput(rows=rows.astype(np.int32), text=np.ones(ids.shape, bool))


def _shardings(tree):
    return jax.tree.map(lambda a: a.sharding, tree)


COMPILER_OPTIONS: dict = {}  # e.g. FAST_CPU_COMPILE for CPU smoke runs
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _compile(fn, in_shardings, out_shardings, args, result: StepResult, graphdef, donate: tuple[int, ...] = ()):
    """``fn`` runs the model ``graphdef``; its digest names the program in ``compiler.compile``'s store."""
    start = time.perf_counter()
    jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate)
    identity = (f"profiling.measure.step {compiler.graph_digest(graphdef)} donate={donate} "
                f"in={in_shardings[1:]!r} out={out_shardings!r}")
    compiled, result.loaded = compiler.compile(jitted, args, identity=identity, extra_options=COMPILER_OPTIONS)
    result.compile_s = time.perf_counter() - start
    result.xla_flops, result.xla_bytes_accessed = _cost(compiled)
    result.memory = _memory(compiled)
    return compiled


def _cost(compiled) -> tuple[float | None, float | None]:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - some backends have none
        return None, None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    if not cost:
        return None, None
    return cost.get("flops"), cost.get("bytes accessed")


def _memory(compiled) -> dict[str, int]:
    try:
        mem = compiled.memory_analysis()
    except Exception:  # noqa: BLE001
        return {}
    if mem is None:
        return {}
    names = {"argument": "argument_size_in_bytes", "output": "output_size_in_bytes",
             "alias": "alias_size_in_bytes", "temp": "temp_size_in_bytes", "code": "generated_code_size_in_bytes"}
    return {k: int(getattr(mem, v)) for k, v in names.items() if getattr(mem, v, None) is not None}


def time_step(step: Step, *, repeats: int, warmup: int = 1) -> None:
    """Run ``warmup`` + ``repeats`` times; record each timed run's wall seconds (or the error that stopped it)."""
    if step.compiled is None:
        return
    try:
        for i in range(warmup + repeats):
            start = time.perf_counter()
            out = step.run()
            elapsed = time.perf_counter() - start
            del out
            if i >= warmup:
                step.result.times_s.append(elapsed)
    except Exception as e:  # noqa: BLE001 - an out-of-memory run is a result to report, not a crash
        step.result.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def hlo_sources(step: Step) -> dict[str, str]:
    """HLO instruction name → where in the model it comes from (``trace.source_label``), for the trace table."""
    try:
        text = step.compiled.as_text()
    except Exception:  # noqa: BLE001 - a backend without the program's text: no sources
        return {}
    return instruction_sources(text)
