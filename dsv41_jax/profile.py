"""Where time and memory go: compile, analyse, time and trace the prefill and decode steps of a config.

    python -m dsv41_jax.profile --config tiny|dsv41_flash|FILE --world N --rows N --position P[,P2,...]
        [--layers K] [--experts E] [--engram [--engram-table-rows N]] [--decode] [--impl xla|pallas]
        [--dtype bfloat16|float32] [--batch B] [--repeats R] [--trace DIR] [--json] [--compile-only]
        [--fast-compile] [--rank-of W]

For every position: the model's step over ``rows`` rows at that position (prefill) and, with ``--decode``, one
row (decode), each compiled with its shardings on ``world`` devices. Per device it reports compile seconds;
XLA's FLOPs and bytes accessed against the spec's arithmetic (``profiling/flops.py``); XLA's argument, output
and temporary bytes against the planner's weights, cache and workspace, with the difference in percent; the
median step time over ``--repeats`` runs and the tokens/s it implies; with ``--trace DIR``, a ``jax.profiler``
trace per step (``DIR/<step>_p<position>``, XProf/TensorBoard open it) and its slowest ops and per-module totals.

Weights are random and made on the devices, sharded (``profiling/build.py``); ``--layers K`` cuts a full-width
model to K layers that keep its layer roles (``profiling/cut.py``); ``--engram`` keeps the config's engram
layers (the first one in any cut), their tables on the devices (``--engram-table-rows`` rows each), and feeds
every step the rows the engine's host hash gives its random ids (the tokenizer package supplies the token
map). The cache holds random entries with its offset at the position, sized position + rows. On CPU,
``--world N`` simulated devices are requested before JAX starts. ``--compile-only`` allocates nothing (abstract
weights): analyses of models too big to run.
``--rank-of W`` times one rank's share of world W on one device (``profiling/cut.one_rank``): a world-W step
without its collectives, where fewer than W GPUs are at hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dsv41_jax import distributed, runspec, with_flags
from dsv41_jax.cli import UsageError, quieted, say  # UsageError: a bad command line, one line and exit code 2
from dsv41_jax.compile_cache import CompileCacheError
from dsv41_jax.compile_cache import enable as enable_compile_cache
from dsv41_jax.config import ConfigError, ModelConfig, load_named
from dsv41_jax.planner import (
    WORLDS,
    GiB,
    MemoryBudget,
    PlanOptions,
    PlanRefused,
    admit,
    cache_pool_bytes,
    engram_bytes_per_rank,
    kernel_tiles,
    param_bytes_per_rank,
    plan_segment,
)
from dsv41_jax.profiling import trace
from dsv41_jax.profiling.cut import cut_layers, kept_layers, one_rank
from dsv41_jax.profiling.flops import step_flops
from dsv41_jax.xla_log import hide_slow_compile_banners


@dataclass(frozen=True)
class Request:
    """What to profile (the parsed command line)."""

    config_name: str
    cfg: ModelConfig
    layers: tuple[int, ...]  # original ids of the layers kept
    world: int
    rows: int
    positions: tuple[int, ...]
    batch: int
    decode: bool
    impl: str
    dtype: str
    repeats: int
    trace_dir: Path | None
    compile_only: bool
    fast_compile: bool
    as_json: bool
    json_out: Path | None = None
    expert_format: str = "dequantized"
    compile_cache: str | None = None
    engram: bool = False
    unrolled: bool = False
    row_parallel_rows: int = 0  # PlanOptions.row_parallel_rows; 0: the planner's default
    rank_of: int = 0  # > 1: the model is one rank's share of this world (profiling/cut.one_rank), run at world 1
    processes: distributed.Processes = distributed.ONE_PROCESS  # the world's processes (process 0 reports)
    dense_format: str = "bf16"  # "fp8": the dense matrices drawn and held as the release stores them
    gemm_inputs: str = "exact"  # "fp8": GEMM inputs rounded to e4m3 + ue8m0 per 32 (ModelOptions.gemm_inputs)


# ------------------------------------------------------------------------------------------------ arguments
def parse_args(argv: list[str] | None) -> Request:
    p = argparse.ArgumentParser(prog="python -m dsv41_jax.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny", help="tiny, dsv41_flash, or a config.json / checkpoint dir")
    p.add_argument("--world", type=int, default=1, help="devices (tensor parallel): 1, 2, 4 or 8")
    p.add_argument("--rows", type=int, default=2048, help="prefill rows per sequence (segment size)")
    p.add_argument("--position", default="0", help="start position(s) of the segment, comma-separated")
    p.add_argument("--layers", type=int, default=None, help="cut the model to K layers (keeps its layer roles)")
    p.add_argument("--engram", action="store_true",
                   help="keep the config's engram layers (the first one in a --layers cut), tables on the devices")
    p.add_argument("--engram-table-rows", type=int, default=None, metavar="N",
                   help="rows of each kept engram table (default: the config's; the release's are 98 GB each)")
    p.add_argument("--experts", type=int, default=None, metavar="E",
                   help="routed experts per layer (default: the config's; fewer let a full-depth model fit one "
                        "device, its scanned units as in the release)")
    p.add_argument("--decode", action="store_true", help="also profile the decode step (one row)")
    p.add_argument("--impl", choices=("xla", "pallas", "reference"), default="xla", metavar="xla|pallas",
                   help="attention, MoE and indexer ops ('reference' = xla, deprecated)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--expert-format", choices=("dequantized", "fp4"), default="dequantized",
                   help="routed experts held in --dtype, or packed fp4 + ue8m0 scales as the release stores them "
                        "(how generate --expert-format auto holds the released checkpoint)")
    p.add_argument("--dense-format", choices=("bf16", "fp8"), default="bf16",
                   help="dense matrices held in --dtype, or as e4m3 codes + block scales as the release stores them")
    p.add_argument("--gemm-inputs", choices=("exact", "fp8"), default="exact",
                   help="GEMM inputs as computed, or rounded to e4m3 + ue8m0 per 32 first (the release's numerics)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per step (median reported)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write jax.profiler traces under DIR (and each step's optimised HLO, optimized_hlo.txt)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--json-out", default=None, metavar="FILE", help="also write the JSON report to FILE")
    p.add_argument("--compile-only", action="store_true", help="abstract weights: compile and analyse, no runs")
    p.add_argument("--fast-compile", action="store_true",
                   help="XLA CPU: LLVM optimisation off (quick smoke runs; step times not representative)")
    p.add_argument("--row-parallel-rows", type=int, default=0, metavar="N",
                   help="world > 1: segments of >= N rows run the HC mixes and norms row-parallel (the planner's "
                        "row_parallel_rows; 0 = its default, off)")
    p.add_argument("--rank-of", type=int, default=0, metavar="W",
                   help="time one rank's share of world W on one device: H/W heads, the widest rank's expert and "
                        "vocabulary slices, the replicated parts whole; no collectives (a world-W step without "
                        "W GPUs; profiling/cut.one_rank)")
    p.add_argument("--unrolled", action="store_true",
                   help="run stacked runs of layers unrolled instead of scanned (same weights; to compare compile "
                        "and step times, docs/DESIGN.md 'Scanned layers')")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="persistent compilation cache (default: $DSV41_JAX_COMPILE_CACHE or ~/.cache/dsv41_jax/xla; "
                        "'off' disables it). Compile seconds then show a cache hit on a second run")
    distributed.add_process_args(p)
    a = p.parse_args(argv)
    processes = distributed.from_args(a)
    try:
        positions = tuple(int(x) for x in str(a.position).split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--position must be integers separated by commas, got {a.position!r}") from None
    checks = [(a.world in WORLDS, f"--world must be one of {', '.join(map(str, WORLDS))}, got {a.world}"),
              (a.rows >= 1, f"--rows must be at least 1, got {a.rows}"),
              (bool(positions) and min(positions) >= 0, f"--position must be >= 0, got {a.position!r}"),
              (a.batch >= 1, f"--batch must be at least 1, got {a.batch}"),
              (a.repeats >= 1, f"--repeats must be at least 1, got {a.repeats}"),
              (a.row_parallel_rows >= 0, f"--row-parallel-rows must be >= 0, got {a.row_parallel_rows}"),
              (not a.rank_of or a.rank_of in WORLDS,
               f"--rank-of must be one of {', '.join(map(str, WORLDS))}, got {a.rank_of}"),
              (not a.rank_of or a.world == 1, f"--rank-of runs one rank on one device: drop --world {a.world}"),
              (not a.rank_of or not a.engram, "--rank-of models the text layers only: drop --engram"),
              (a.layers is None or a.layers >= 1, f"--layers must be at least 1, got {a.layers}"),
              (a.experts is None or a.experts >= 1, f"--experts must be at least 1, got {a.experts}"),
              (a.engram_table_rows is None or a.engram, "--engram-table-rows goes with --engram"),
              (a.engram_table_rows is None or a.engram_table_rows >= 1024,
               f"--engram-table-rows must be at least 1024, got {a.engram_table_rows}")]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)
    cfg = load_named(a.config)
    if a.engram and not cfg.engram_layer_ids:
        raise UsageError(f"--engram: config {a.config!r} has no engram layers")
    k = a.layers or cfg.num_hidden_layers
    layers = tuple(kept_layers(cfg, k, engram=a.engram))
    cfg = cut_layers(cfg, k, engram=a.engram, engram_table_rows=a.engram_table_rows, routed_experts=a.experts)
    if a.rank_of > 1:
        cfg = one_rank(cfg, a.rank_of)  # PlanRefused (R4) for a world that cannot split the heads
    last = max(positions) + a.rows
    if last > cfg.max_position_embeddings:
        raise UsageError(f"position {max(positions):,} + {a.rows:,} rows passes the model's "
                         f"{cfg.max_position_embeddings:,} positions")
    if a.json_out is not None:
        _check_writable(Path(a.json_out))
    admit(cfg, a.world)  # PlanRefused names the rule and the worlds that work
    return Request(a.config, cfg, layers, a.world, a.rows, positions, a.batch, a.decode, a.impl, a.dtype,
                   a.repeats, Path(a.trace) if a.trace else None, a.compile_only, a.fast_compile, a.json,
                   Path(a.json_out) if a.json_out else None, a.expert_format, a.compile_cache, a.engram,
                   a.unrolled, a.row_parallel_rows, a.rank_of, processes, a.dense_format, a.gemm_inputs)


def _check_writable(path: Path) -> None:
    """--json-out: refuse before the run a file whose directory is missing or not writable."""
    folder = path.resolve().parent
    if not folder.is_dir():
        raise UsageError(f"--json-out: directory {folder} does not exist")
    if path.is_dir() or not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"--json-out: cannot write {path}")


# ------------------------------------------------------------------------------------------------- planner
def planner_bytes(req: Request, rows: int, position: int) -> dict:
    """The planner's per-device predictions for one step: weights, cache, workspace (None + note if refused).

    Formats as the model holds them: weights in ``--dtype`` (fp4 experts, fp8 dense matrices where asked); cache
    rows bf16 (``kv="bf16"``), sized like the
    profiled cache (``position + rows`` tokens a sequence, ``batch`` slots).
    """
    fmt = "bf16" if req.dtype == "bfloat16" else "f32"
    experts = "fp4" if req.expert_format == "fp4" else fmt
    dense = "fp8" if req.dense_format == "fp8" else fmt
    options = PlanOptions(kv="bf16", experts=experts, dense=dense, slots=req.batch, indexer_impl=req.impl,
                          context_limit=position + req.rows if req.impl == "pallas" else None)
    capacity = req.batch * (position + req.rows)
    engram = engram_bytes_per_rank(req.cfg, req.world, tables="device", dense=dense, rows=req.batch * rows)
    out = {"weights": param_bytes_per_rank(req.cfg, req.world, 0, experts=experts, dense=dense)
           + engram["tables"] + engram["projection"],
           "cache": cache_pool_bytes(req.cfg, req.world, options, MemoryBudget(kv_tokens=capacity)),
           "workspace": None, "refused": None}
    try:
        out["workspace"] = plan_segment(req.cfg, req.world, 0, rows, position, options).workspace_total
    except PlanRefused as e:
        out["refused"] = str(e)
    return out


def _diff_pct(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return 100.0 * (predicted - measured) / measured


# --------------------------------------------------------------------------------------------------- running
def run(req: Request, on_step=None) -> dict:
    """Build, compile, analyse, time and trace; returns the report (the ``--json`` object).

    ``on_step(report, entry)`` is called after each step, so a run cut short still shows what it measured.
    """
    # JAX and what brings it: imported once main() has set XLA_FLAGS (simulated devices, command buffers).
    import jax  # noqa: PLC0415 - after XLA_FLAGS are set (see above)

    from dsv41_jax.compiler import compiling_note  # noqa: PLC0415 - brings JAX (see above)
    from dsv41_jax.engram import EngramError, Hasher  # noqa: PLC0415 - brings JAX (see above)
    from dsv41_jax.profiling import build, measure  # noqa: PLC0415 - brings JAX (see above)

    cache_dir = enable_compile_cache(distributed.cache_dir(req.compile_cache))
    hasher = None
    if req.cfg.engram_layer_ids:
        try:
            hasher = Hasher(req.cfg)
        except EngramError as e:
            raise UsageError(f"--engram: {e}") from None
    measure.COMPILER_OPTIONS.clear()
    if req.fast_compile:
        measure.COMPILER_OPTIONS.update(measure.FAST_CPU_COMPILE)
    spec = runspec.RunSpec(config=req.config_name, world=req.world, dtype=req.dtype, impl=req.impl,
                           expert_format=req.expert_format, scan_layers=not req.unrolled,
                           dense_format=req.dense_format, gemm_inputs=req.gemm_inputs)
    tiles = kernel_tiles(req.cfg, req.world, PlanOptions(row_parallel_rows=req.row_parallel_rows))
    options = runspec.model_options(spec, req.expert_format, tiles=tiles)
    _check_fits(req, jax.local_devices()[0])
    steps = len(req.positions) * (2 if req.decode else 1)
    say(compiling_note(f"{steps} step program{'s' if steps > 1 else ''} of {req.config_name} (each compile is "
                       f"timed apart)"))
    start = time.perf_counter()
    model, mesh = runspec.device_model(req.cfg, spec, options, abstract=req.compile_only)
    weights_on_device = build.bytes_per_device(_params(model))
    if not req.compile_only:
        jax.block_until_ready(jax.tree.leaves(_params(model)))
    report = _header(req, jax)
    report["build_s"] = time.perf_counter() - start
    report["compile_cache"] = str(cache_dir) if cache_dir is not None else None
    report["weights_per_device"] = weights_on_device
    for position in req.positions:
        cache = build.build_cache(req.cfg, mesh, batch=req.batch, position=position, rows=req.rows,
                                  dtype=req.dtype, abstract=req.compile_only)
        cache_bytes = build.bytes_per_device(cache)
        makers = [("prefill", lambda cache=cache: measure.prefill_step(model, cache, rows=req.rows,
                                                                       position=position, hasher=hasher))]
        if req.decode:  # the last user of this cache: it is donated when it has a free row for every run
            donate = req.rows >= req.repeats + _EXTRA_DECODE_RUNS
            makers.append(("decode", lambda cache=cache: measure.decode_step(model, cache, position=position,
                                                                             hasher=hasher, donate=donate)))
        for kind, make in makers:
            step = make()
            if not req.compile_only:
                measure.time_step(step, repeats=req.repeats)
            entry = _step_report(req, step, weights_on_device, cache_bytes)
            if not req.compile_only:
                entry["floor"] = _floor(req, model, entry)
            if req.trace_dir is not None and step.result.times_s:
                entry["trace"] = _trace(req, step, jax, measure)
            report["steps"].append(entry)
            if on_step is not None:
                on_step(report, entry)
            del step
        del cache, makers
    return report


_EXTRA_DECODE_RUNS = 5  # a decode step's runs beyond --repeats: the warm-up and up to 3 traced, +1 spare


def _params(model):
    from flax import nnx  # noqa: PLC0415 - brings JAX: after XLA_FLAGS are set
    return nnx.state(model, nnx.Param)


def _check_fits(req: Request, device) -> None:
    """Refuse (one line) a run whose planned weights + caches cannot fit the device's memory, or on a CPU the
    host's available memory, which its simulated devices share (the full-width model's two layers, ~57 GB, were
    killed by the kernel's OOM killer with no message)."""
    if req.compile_only:
        return
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    plan = planner_bytes(req, req.rows, max(req.positions))
    need = plan["weights"] + plan["cache"]
    if limit and need > limit:
        raise UsageError(f"weights + cache need {need / GiB:,.1f} GiB per device, {device.device_kind} has "
                         f"{limit / GiB:,.1f} GiB: use --layers K, a larger --world, or --compile-only")
    host = available_host_bytes() if not limit and device.platform == "cpu" else None
    if host and need * req.world > host:
        raise UsageError(f"weights + cache need {need * req.world / GiB:,.2f} GiB of host memory ({req.world} "
                         f"simulated CPU device{'s' if req.world > 1 else ''}), {host / GiB:,.2f} GiB is available: "
                         "use --layers K, --experts E, a smaller config (tiny), or --compile-only")


def available_host_bytes() -> int | None:
    """The host memory available to a new allocation (Linux's MemAvailable), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _header(req: Request, jax) -> dict:
    device = jax.local_devices()[0]
    return {"config": req.config_name, "layers": list(req.layers), "num_layers": req.cfg.num_hidden_layers,
            "roles": [req.cfg.role(i) for i in range(req.cfg.num_hidden_layers)],
            "world": req.world, "rows": req.rows, "batch": req.batch, "impl": req.impl, "dtype": req.dtype,
            "expert_format": req.expert_format, "dense_format": req.dense_format, "gemm_inputs": req.gemm_inputs,
            "engram": [{"layer": req.layers[i], "table_rows": n}
                       for i, n in zip(req.cfg.engram_layer_ids, req.cfg.engram_num_embeddings)],
            "compile_only": req.compile_only, "fast_compile": req.fast_compile,
            "units": [list(u) for u in req.cfg.layer_units()], "scanned": not req.unrolled,
            "row_parallel_rows": req.row_parallel_rows, "rank_of": req.rank_of,
            "platform": device.platform, "device": device.device_kind, "jax": jax.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "steps": []}


def _step_report(req: Request, step, weights: int, cache: int) -> dict:
    r = step.result
    spec = step_flops(req.cfg, r.rows, r.position, req.world, req.batch)
    spec_total = sum(spec.values())
    plan = planner_bytes(req, r.rows, r.position)
    mem = r.memory
    inputs = req.batch * r.rows * 4 + req.batch * 4  # ids [B, T] and lengths [B], int32
    logits_out = req.batch * req.cfg.vocab_size * 4 + req.batch * 4  # last-row logits f32 + next token
    memory = {
        "weights": _pair(plan["weights"], weights),
        "cache": _pair(plan["cache"], cache),
        "arguments": _pair(plan["weights"] + plan["cache"] + inputs, mem.get("argument")),
        "outputs": _pair(plan["cache"] + logits_out, mem.get("output")),
        "temporaries": _pair(plan["workspace"], mem.get("temp")),
    }
    return {
        "kind": r.kind, "rows": r.rows, "position": r.position, "compile_s": r.compile_s,
        "compile_loaded": r.loaded, "donated": step.chained,
        "flops": {"xla": r.xla_flops, "spec": spec_total, "spec_parts": spec,
                  "xla_over_spec": (r.xla_flops / spec_total) if r.xla_flops and spec_total else None},
        "bytes_accessed_xla": r.xla_bytes_accessed,
        "memory": memory, "planner_refused": plan["refused"],
        "times_s": r.times_s, "median_s": r.median_s, "tokens_per_s": r.tokens_per_s, "error": r.error,
    }


def _floor(req: Request, model, entry: dict) -> dict:
    """The step's H200 floors (`profiling/floors.py`): the weights (and, decoding, the cache) one device reads,
    the spec's FLOPs per device; seconds at 4.3 TB/s and 668 TFLOP/s, and the measured median over the larger."""
    from dsv41_jax.profiling import floors  # noqa: PLC0415 - brings JAX: after XLA_FLAGS are set

    rows = entry["rows"] * req.batch
    nbytes, _ = floors.weight_bytes(model, req.cfg, rows)
    if entry["kind"] == "decode":
        nbytes += floors.cache_bytes(req.cfg, req.batch, entry["position"])
    out = {"read_bytes": nbytes, **floors.step_floor(nbytes, entry["flops"]["spec"])}
    out["ratio"] = entry["median_s"] / out["floor_s"] if entry["median_s"] else None
    return out


def _pair(predicted: int | None, xla: int | None) -> dict:
    return {"xla": xla, "predicted": predicted, "diff_pct": _diff_pct(predicted, xla)}


def _trace(req: Request, step, jax, measure) -> dict:
    folder = req.trace_dir / f"{step.result.kind}_p{step.result.position}"
    steps = min(req.repeats, 3)
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        for _ in range(steps):
            step.run()
    try:  # the optimised program beside its trace: the fusion behind any op name the table shows
        (folder / "optimized_hlo.txt").write_text(step.compiled.as_text())
    except Exception:  # noqa: BLE001 - a backend without the text: the trace still stands
        pass
    found = trace.perfetto_file(folder)
    if found is None:
        return {"dir": str(folder), "error": "no Perfetto trace written"}
    events, sources = trace.load_events(found), measure.hlo_sources(step)
    ops = trace.op_times(events, sources, steps, req.world)
    other = trace.unattributed_times(events, sources, steps)
    return {"dir": str(folder), "file": str(found), "op_seconds": sum(o.seconds for o in ops),
            "unattributed": [{"name": o.name, "seconds": o.seconds, "launches": o.count} for o in other],
            "components": [{"source": s, "seconds": t} for s, t in trace.by_component(ops)],
            "layers": [{"scope": s, "seconds": t} for s, t in trace.by_layer(ops)],
            "parts": [{"part": s, "seconds": t} for s, t in trace.by_part(ops)],
            "ops": [{"op": o.name, "source": o.source, "seconds": o.seconds, "launches": o.count}
                    for o in ops]}


# -------------------------------------------------------------------------------------------------- printing
def _fmt_bytes(b) -> str:
    if b is None:
        return "—"
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(b) >= size:
            return f"{b / size:,.2f} {unit}"
    return f"{b:,} B"


def _fmt_pct(x) -> str:
    return "—" if x is None else f"{x:+.1f} %"


def print_header(report: dict, out=sys.stdout) -> None:
    world = (f"one rank of world {report['rank_of']} on one device (no collectives)" if report.get("rank_of", 0) > 1
             else f"world {report['world']}")
    out.write(f"{report['config']} layers {report['layers']} ({', '.join(report['roles'])}) · {world}"
              f" · batch {report['batch']} · {report['dtype']} · experts "
              f"{report.get('expert_format', 'dequantized')} · dense {report.get('dense_format', 'bf16')} · impl "
              f"{report['impl']}\n")
    for e in report.get("engram", []):
        out.write(f"engram layer {e['layer']}: table {e['table_rows']:,} rows on the devices, rows hashed on the "
                  f"host as the engine feeds them\n")
    out.write(f"{report['device']} ({report['platform']}) · jax {report['jax']} · {report['date']} · weights "
              f"{_fmt_bytes(report['weights_per_device'])} per device · built in {report['build_s']:.1f} s\n")


def print_step(s: dict, out=sys.stdout) -> None:
    w = out.write
    w(f"\n== {s['kind']} · {s['rows']:,} rows at position {s['position']:,} ==\n")
    if s["error"]:
        w(f"  error: {s['error']}\n")
    f = s["flops"]
    compile_ = f"compile {s['compile_s']:.1f} s{' (loaded from the cache)' if s['compile_loaded'] else ''}"
    w(f"  {compile_} · FLOPs/device XLA {_num(f['xla'])} vs spec {_num(f['spec'])} "
      f"(x{f['xla_over_spec']:.2f})\n" if f["xla_over_spec"] else
      f"  {compile_} · FLOPs/device spec {_num(f['spec'])} (XLA: none)\n")
    w(f"  bytes accessed (XLA) {_fmt_bytes(s['bytes_accessed_xla'])}\n")
    w(f"  {'memory/device':<14}{'XLA':>14}{'planner':>14}{'diff':>10}\n")
    for name, m in s["memory"].items():
        w(f"  {name:<14}{_fmt_bytes(m['xla']):>14}{_fmt_bytes(m['predicted']):>14}{_fmt_pct(m['diff_pct']):>10}\n")
    if s["planner_refused"]:
        w(f"  planner refused this segment: {s['planner_refused']}\n")
    if s["median_s"]:
        w(f"  median {s['median_s'] * 1e3:,.2f} ms over {len(s['times_s'])} runs · "
          f"{s['tokens_per_s']:,.1f} tokens/s\n")
    if s.get("floor") and s["floor"]["ratio"]:
        fl = s["floor"]
        w(f"  H200 floor {fl['floor_s'] * 1e3:,.3f} ms (read {_fmt_bytes(fl['read_bytes'])}: "
          f"{fl['read_s'] * 1e3:,.3f} ms; compute {fl['compute_s'] * 1e3:,.3f} ms) · step/floor {fl['ratio']:.2f}x\n")
    if "trace" in s:
        _print_trace(s["trace"], s["median_s"], w)
    out.flush()


def print_report(report: dict, out=sys.stdout) -> None:
    print_header(report, out)
    for s in report["steps"]:
        print_step(s, out)


def _print_trace(t: dict, median_s, w) -> None:
    if "error" in t:
        w(f"  trace: {t['error']}\n")
        return
    total = t["op_seconds"] or 1.0
    covered = f" ({100 * t['op_seconds'] / median_s:.0f} % of the median step)" if median_s else ""
    w(f"  trace {t['dir']} · attributed ops {t['op_seconds'] * 1e3:,.2f} ms a step{covered}\n")
    w("  by module: " + ", ".join(f"{c['source']} {100 * c['seconds'] / total:.0f} %" for c in t["components"][:8])
      + "\n")
    if t.get("parts"):
        w("  by part: " + ", ".join(f"{c['part']} {c['seconds'] * 1e3:,.2f} ms" for c in t["parts"]) + "\n")
    if t.get("layers"):
        w("  by layer: " + ", ".join(f"{c['scope']} {100 * c['seconds'] / total:.0f} %" for c in t["layers"]) + "\n")
    for o in t["ops"][:10]:
        w(f"    {o['seconds'] * 1e3:9.3f} ms {100 * o['seconds'] / total:5.1f} %  {o['op']:<36} {o['source']}\n")
    other = t.get("unattributed") or []
    if other:  # device copies and the like: no instruction of the program names them
        w(f"  on the device outside the program's ops: {sum(o['seconds'] for o in other) * 1e3:,.2f} ms a step · "
          + ", ".join(f"{o['name'][:40]} ×{o['launches']} {o['seconds'] * 1e3:,.3f} ms" for o in other[:5]) + "\n")


def _num(x) -> str:
    if x is None:
        return "—"
    for unit, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if abs(x) >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{x:,.0f}"


# ------------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    """The command; ``argv`` None (this process's own command line): XLA's slow-compile banners are kept off its
    stderr (`xla_log`)."""
    if argv is None:
        hide_slow_compile_banners()
    try:
        req = parse_args(argv)
    except (UsageError, ConfigError, PlanRefused) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from sharding import ShardingError, request_host_devices  # noqa: PLC0415 - brings JAX: XLA_FLAGS are set here

    # CPU: simulated devices; only effective before JAX starts
    request_host_devices(distributed.local_devices(req.world, req.processes))
    if req.trace_dir is not None:
        one_kernel_per_op()
    try:
        runspec.start(dataclasses.replace(runspec.RunSpec(), world=req.world, processes=req.processes))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def on_step(report: dict, entry: dict) -> None:
        if req.json_out is not None and not quieted():  # one process writes it
            req.json_out.write_text(json.dumps(report, indent=1))
        if not req.as_json:
            if len(report["steps"]) == 1:
                print_header(report)
            print_step(entry)

    try:
        report = run(req, on_step)
    except (UsageError, ShardingError, CompileCacheError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if req.as_json:
        print(json.dumps(report, indent=1))
    return 1 if any(s["error"] for s in report["steps"]) else 0


def one_kernel_per_op() -> None:
    """GPU: no CUDA-graph command buffers, so the trace has one kernel event per XLA op to attribute (inside a
    command buffer the kernels are not named by op). Must run before JAX starts; a no-op on CPU."""
    os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""), {"xla_gpu_enable_command_buffer": ""})


if __name__ == "__main__":
    sys.exit(main())
