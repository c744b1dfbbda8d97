"""Decode against its weight-read floor: the engine's own one-row step program
on a cut of the model with random weights drawn on the devices (`dsv41_jax.profiling.build`), a random cache
filled to the position, for each world, expert format, batch and position.

    python benchmarks/bench_decode.py                          # H200: flash 2-layer cut, worlds 1/2(/4), the grid
    python benchmarks/bench_decode.py --quick                  # one world, batch 1, position 0, bf16, 32 tokens
    python benchmarks/bench_decode.py --config tiny --quick    # CPU smoke run (tests/test_bench_decode.py)
    python benchmarks/bench_decode.py --worlds 1 --rank-of 2,4 # one GPU: one rank's share of worlds 2 and 4
    python benchmarks/bench_decode.py --worlds none --rank-of 8 --layers 40 --experts 24   # rank cases only

Per case it prints:

* ``step ms``: the step program (forward of the last tokens + sampling + stop flags, cache donated) chained
  ``--steps`` times on the device with one wait at the end (``Engine.step_seconds``): the device-bound rate, for
  greedy sequences (the argmax-only program); ``sampled``: the same with temperature 1 and top-p 0.9 (the
  sampling filters sort the vocabulary every step);
* ``floor ms``: the bytes the step must read ÷ 4.3 TB/s (``--bandwidth``), per device: every weight but the
  routed experts and the embedding (B rows), the routed experts the batch touches (expected distinct experts per
  layer under uniform routing, E·(1 − (1 − k/E)^B)), and the cache the step reads (window rings, the top-k
  compressed entries, and every index key an indexer scores: ⌊position / r⌋ rows);
* ``ratio`` = step / floor;
* ``gen tok/s``: ``Engine.decode_from`` over ``--tokens`` new tokens per sequence (the host loop included: token
  reads, queueing, stop bookkeeping), next to ``step tok/s`` = batch / step, and their quotient; one row per
  ``--decode-chunks`` value k (``Engine(decode_chunk=k)``: k steps per program call, ``chunk`` column).

``--rank-of W``: also one rank's share of world W on one device (`dsv41_jax.profiling.cut.one_rank`: H/W heads,
the widest rank's expert and vocabulary slices, the replicated parts whole), shown as world ``1/W``: a world-W
step without its collectives, where fewer than W GPUs are at hand. ``--worlds none`` runs only those cases (no
whole-world case, which may not fit one device).

With ``--trace DIR`` also ``kernels``: the share of the step inside the first device's kernels and copies, from a
``jax.profiler`` trace of a few chained steps per case (`dsv41_jax.profiling.trace.device_timeline`), with XLA's
command buffers on as the step runs; on a device a second table (and the JSON's ``timeline``) gives a traced step's
busy time, the gaps inside it (those over 5 µs), the gap between two steps (the host's launch when late; the
profiler slows the host, so read it as an upper bound) and the device copies. ``dsv41_jax.profile --trace``
names each op instead (command buffers off). On a CPU the share is the program's XLA ops on the host's threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

from dsv41_jax import runspec
from dsv41_jax.config import ConfigError, load_named
from dsv41_jax.engine import Engine, Request
from dsv41_jax.planner import PlanRefused
from dsv41_jax.profiling import build, trace
from dsv41_jax.profiling.args import comma_ints, rank_of_worlds, world_label
from dsv41_jax.profiling.cut import cut_layers, one_rank
from dsv41_jax.profiling.floors import H200_BYTES_PER_S, cache_bytes, weight_bytes
from dsv41_jax.runspec import RunSpec
from dsv41_jax.sampling import SamplingParams

TRACE_STEPS = 3
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9)  # the `sampled` column's settings
FORMATS = {"bf16": "dequantized", "fp4": "fp4"}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="dsv41_flash", help="tiny, dsv41_flash, or a config.json / checkpoint dir")
    p.add_argument("--layers", type=int, default=2, help="cut the model to K layers (keeps its layer roles)")
    p.add_argument("--experts", type=int, default=None, metavar="E",
                   help="routed experts per layer (default: the config's). Fewer let the whole model fit one "
                        "device: its scanned units and their loops run as in the release, and at batch 1 a step "
                        "reads as many experts a layer as with all of them")
    p.add_argument("--worlds", default=None,
                   help="comma-separated worlds (default: 1, 2, 4 as devices allow); none: only the --rank-of cases")
    p.add_argument("--rank-of", default="", metavar="W[,W2]",
                   help="also time one rank's share of these worlds on one device (world column 1/W; no collectives)")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--positions", default="0,300000", help="comma-separated cache positions")
    p.add_argument("--formats", default="bf16,fp4", help="routed expert formats: bf16, fp4")
    p.add_argument("--dense-format", choices=("bf16", "fp8"), default="bf16",
                   help="dense matrices in bf16, or fp8 codes + block scales as the release stores them")
    p.add_argument("--gemm-inputs", choices=("exact", "fp8"), default="exact",
                   help="GEMM inputs as computed, or rounded to e4m3 + ue8m0 per 32 first (the release's numerics)")
    p.add_argument("--tokens", type=int, default=256, help="new tokens per sequence in the generate loop")
    p.add_argument("--decode-chunks", default="1", help="comma-separated decode steps per program call for the "
                   "generate loop (Engine decode_chunk), one row each")
    p.add_argument("--steps", type=int, default=64, help="chained steps timed for the step-only rate")
    p.add_argument("--impl", choices=("xla", "pallas"), default=None,
                   help="kernels (default: pallas on GPU, xla elsewhere)")
    p.add_argument("--bandwidth", type=float, default=H200_BYTES_PER_S,
                   help=f"bytes/s of the floor (default {H200_BYTES_PER_S:.2g}, the H200's)")
    p.add_argument("--quick", action="store_true", help="first world, batch 1, position 0, bf16, 32 tokens")
    p.add_argument("--json-out", default=None, metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument("--trace", default=None, metavar="DIR", help="trace a few steps per case under DIR: the share "
                   "of the step inside the device's kernels and copies, the gaps between them (command buffers on)")
    a = p.parse_args(argv)
    try:
        a.batches = comma_ints(a.batches, "--batches")
        a.positions = comma_ints(a.positions, "--positions", minimum=0)
        a.decode_chunks = comma_ints(a.decode_chunks, "--decode-chunks")
        a.formats = [f.strip() for f in a.formats.split(",") if f.strip()]
        bad = [f for f in a.formats if f not in FORMATS]
        if bad or not a.formats:
            raise ValueError(f"--formats takes bf16 and/or fp4, got {a.formats}")
        devices = len(jax.devices())
        a.rank_of = rank_of_worlds(a.rank_of)
        if a.worlds == "none":
            a.worlds = []
            if not any(w > 1 for w in a.rank_of):
                raise ValueError("--worlds none runs only the --rank-of cases: give --rank-of W (W > 1)")
        else:
            a.worlds = comma_ints(a.worlds, "--worlds") if a.worlds else [w for w in (1, 2, 4) if w <= devices]
        if a.worlds and max(a.worlds) > devices:
            raise ValueError(f"--worlds {max(a.worlds)} needs {max(a.worlds)} devices, {devices} present")
        if a.tokens < 1 or a.steps < 1 or a.layers < 1:
            raise ValueError("--tokens, --steps and --layers must be at least 1")
        if a.experts is not None and a.experts < 1:
            raise ValueError(f"--experts must be at least 1, got {a.experts}")
    except ValueError as e:
        p.exit(2, f"bench_decode: {e}\n")
    if a.quick:
        a.worlds, a.batches, a.positions, a.formats = a.worlds[:1], [1], [0], ["bf16"]
        a.tokens, a.steps = min(a.tokens, 32), min(a.steps, 16)
    a.impl = runspec.kernel_impl(a.impl or "auto")
    return a


def run_case(model, mesh, cfg, *, batch: int, position: int, tokens: int, steps: int, bandwidth: float,
             trace_dir: Path | None = None, chunks: tuple[int, ...] = (1,)) -> list[dict]:
    """One row per decode chunk: the step-only figures (measured once) and that chunk's generate-loop rate."""
    capacity = position + 2 * (steps + 1) + tokens + 2 + (TRACE_STEPS + 1 if trace_dir else 0) + max(chunks)
    engine = Engine(model, cfg, max_context=capacity, eos_ids=(), mesh=mesh)
    last = np.random.default_rng(position + batch).integers(0, cfg.vocab_size, batch).astype(np.int32)

    def fresh_cache():
        return build.build_cache(cfg, mesh, batch=batch, position=position, rows=capacity - position,
                                 dtype="bfloat16")

    cache = fresh_cache()
    t0 = time.perf_counter()
    step_s, cache, program = engine.step_seconds(cache, last, steps)
    sampled_s, cache, _ = engine.step_seconds(cache, last, steps, SAMPLED)
    kernel_s = timeline = None
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            cache = engine.step_seconds(cache, last, TRACE_STEPS).cache
        found = trace.perfetto_file(trace_dir)
        if found is not None:  # the warm-up call is traced too: TRACE_STEPS + 1 steps
            events = trace.load_events(found)
            timeline = trace.device_timeline(events, TRACE_STEPS + 1)
            if timeline is not None:  # a device's activities, command buffers on as the step runs
                kernel_s = timeline.busy_s
            else:  # CPU: the program's XLA ops on the host's threads
                ops = trace.op_times(events, trace.instruction_sources(program.as_text()), TRACE_STEPS + 1,
                                     mesh.size)
                kernel_s = sum(o.seconds for o in ops)
    weights, touched = weight_bytes(model, cfg, batch)
    kv = cache_bytes(cfg, batch, position)
    floor_s = (weights + kv) / bandwidth
    rows = []
    for i, chunk in enumerate(chunks):
        if i:
            engine, cache = Engine(model, cfg, max_context=capacity, eos_ids=(), mesh=mesh,
                                   decode_chunk=chunk), fresh_cache()
        elif chunk != 1:
            engine = Engine(model, cfg, max_context=capacity, eos_ids=(), mesh=mesh, decode_chunk=chunk)
        engine.decode_from(cache, last, [Request((0,), 2 * chunk + 1)] * batch)  # compiles the chunk program
        out = engine.decode_from(fresh_cache(), last, [Request((0,), tokens)] * batch)
        gen_tok_s = out.timings.generated_tokens / out.timings.decode_s
        rows.append({"batch": batch, "position": position, "chunk": chunk, "step_ms": step_s * 1e3,
                     "floor_ms": floor_s * 1e3, "ratio": step_s / floor_s, "weight_gb": weights / 1e9,
                     "cache_gb": kv / 1e9, "experts_per_layer": touched, "step_tok_s": batch / step_s,
                     "gen_tok_s": gen_tok_s, "gen_over_step": gen_tok_s / (batch / step_s),
                     "sampled_ms": sampled_s * 1e3, "tokens": out.timings.generated_tokens,
                     "case_s": time.perf_counter() - t0,
                     "kernel_share": None if kernel_s is None else kernel_s / step_s,
                     "timeline": None if timeline is None else dataclasses.asdict(timeline)})
    return rows


HEADER = (f"{'world':>5} {'experts':>7} {'batch':>5} {'position':>8} {'chunk':>5} {'step ms':>8} {'sampled':>8} "
          f"{'floor ms':>8} {'ratio':>6} "
          f"{'exp/layer':>9} {'step tok/s':>10} {'gen tok/s':>10} {'gen/step':>8} {'kernels':>7}")


def fmt_row(r: dict) -> str:
    return (f"{world_label(r):>5} {r['experts']:>7} {r['batch']:>5} {r['position']:>8} {r['chunk']:>5} "
            f"{r['step_ms']:>8.4g} {r['sampled_ms']:>8.4g} "
            f"{r['floor_ms']:>8.4g} {r['ratio']:>6.3g} {r['experts_per_layer']:>9.1f} {r['step_tok_s']:>10.1f} "
            f"{r['gen_tok_s']:>10.1f} {r['gen_over_step']:>8.1%} "
            f"{'-' if r['kernel_share'] is None else format(r['kernel_share'], '.0%'):>7}")


TIMELINE_HEADER = (f"{'world':>5} {'experts':>7} {'batch':>5} {'position':>8} {'step ms':>8} {'busy ms':>8} "
                   f"{'gaps ms':>8} {'>5µs ms':>8} {'between':>8} {'copies':>8} {'acts':>5}   (traced steps)")


def fmt_timeline(r: dict) -> str:
    """A traced case's device timeline a step: busy, gaps inside the step (over 5 µs), the gap between two steps
    (the host's lateness, a profiler's cost included), copies, activities."""
    t = r["timeline"]
    ms = lambda key: f"{t.get(key, 0.0) * 1e3:>8.3f}"
    return (f"{world_label(r):>5} {r['experts']:>7} {r['batch']:>5} {r['position']:>8} {r['step_ms']:>8.4g} "
            f"{ms('busy_s')} {ms('gap_s')} {ms('long_gap_s')} {ms('between_s')} {ms('copy_s')} {t['activities']:>5}")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        cfg = cut_layers(load_named(a.config), a.layers, routed_experts=a.experts)
        cases = [(w, 0, cfg) for w in a.worlds] + [(1, w, one_rank(cfg, w)) for w in a.rank_of if w > 1]
    except (ConfigError, PlanRefused, OSError, ValueError) as e:
        print(f"bench_decode: {e}", file=sys.stderr)
        return 2
    dev = jax.devices()[0]
    print(f"bench_decode {time.strftime('%Y-%m-%d')} · {dev.platform} {getattr(dev, 'device_kind', '')} · "
          f"jax {jax.__version__} · {a.config} cut to {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} "
          f"routed experts a layer · dense {a.dense_format} · GEMM inputs {a.gemm_inputs} · impl {a.impl} · "
          f"{a.tokens} tokens, {a.steps} chained steps · floor at {a.bandwidth / 1e12:.1f} TB/s", flush=True)
    rows = []
    for world, rank_of, case_cfg in cases:
        name = f"world {world}" if not rank_of else f"one rank of world {rank_of}"
        for fmt in a.formats:
            spec = RunSpec(world=world, impl=a.impl, expert_format=FORMATS[fmt], dense_format=a.dense_format,
                           gemm_inputs=a.gemm_inputs)
            t0 = time.perf_counter()
            model, mesh = runspec.device_model(case_cfg, spec, runspec.model_options(spec, FORMATS[fmt]))
            print(f"{name} {fmt}: model drawn in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                  flush=True)
            for batch in a.batches:
                for position in a.positions:
                    r = {"world": world, "rank_of": rank_of, "experts": fmt, "dense": a.dense_format}
                    try:
                        folder = (Path(a.trace) / f"{'w' if not rank_of else 'rank_of'}{rank_of or world}_{fmt}"
                                  f"_b{batch}_p{position}" if a.trace else None)
                        case = run_case(model, mesh, case_cfg, batch=batch, position=position, tokens=a.tokens,
                                        steps=a.steps, bandwidth=a.bandwidth, trace_dir=folder,
                                        chunks=tuple(a.decode_chunks))
                    except Exception as e:  # noqa: BLE001 - e.g. out of memory: reported, the grid goes on
                        r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                        print(f"{name} {fmt} batch {batch} position {position}: {r['error']}",
                              file=sys.stderr, flush=True)
                        rows.append(r)
                        continue
                    for c in case:
                        rows.append({**r, **c})
                        print(f"{fmt_row(rows[-1])}   ({c['case_s']:.1f} s)", file=sys.stderr, flush=True)
            del model, mesh
    print(HEADER)
    for r in rows:
        print(fmt_row(r) if "error" not in r else f"{world_label(r):>5} {r['experts']:>7}  {r['error']}")
    traced = [r for r in rows if r.get("timeline") and r["chunk"] == a.decode_chunks[0]]  # once a case
    if traced:  # --trace on a device: where each step's time went, command buffers on (``trace.device_timeline``)
        print(TIMELINE_HEADER)
        for r in traced:
            print(fmt_timeline(r))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"device": str(dev.device_kind if hasattr(dev, "device_kind") else dev),
                       "jax": jax.__version__, "config": a.config, "layers": cfg.num_hidden_layers,
                       "routed_experts": cfg.n_routed_experts, "impl": a.impl,
                       "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows}, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
