"""Prefill against its floors: one segment of ``--rows`` rows through a cut
of the model with random weights made on the devices, for each world, cut, segment size and expert format, via
``python -m dsv41_jax.profile`` (its build, compile, timing and trace), in one run.

    python benchmarks/bench_prefill.py                            # GPUs: flash cuts 2/16/40, worlds 1/2/4, 2K/4K rows
    python benchmarks/bench_prefill.py --worlds 1 --layers 2 --rows 2048 --formats bf16
    python benchmarks/bench_prefill.py --worlds 1 --rank-of 2,4 --layers 2 --rows 2048   # one GPU: worlds 2, 4 per rank
    python benchmarks/bench_prefill.py --worlds none --rank-of 8 --layers 40            # the rank cases only
    python benchmarks/bench_prefill.py --config tiny --quick      # CPU smoke run (tests/test_bench_prefill.py)

Per case it prints:

* ``step ms``: the median prefill step (``profile``'s, ``--repeats`` runs);
* ``read ms``: the weights one device must read (every weight but the embedding, the routed experts the
  segment touches: all of them at 2,048 rows) ÷ ``--bandwidth`` (H200: 4.3 TB/s); ``compute ms``: the spec's
  FLOPs per device (`profiling/flops.py`) ÷ ``--flops`` (H200 bf16 GEMM: 668 TFLOP/s); ``floor`` = the larger;
* ``ratio`` = step / floor, and ``tok/s``; ``rp``: the segment's row-parallel threshold (``--row-parallel-rows``,
  the planner's ``row_parallel_rows``; 0 = off; world 1 runs 0 only);
* with ``--trace DIR`` (the default: a directory under /tmp) ``kernels``, the share of the step inside kernels,
  and the step split by model part (moe, attention, indexer, hc, compressor, head, ...) from the trace.
  XLA's command buffers are then off for the whole run, as in ``profile --trace``.

``--rank-of W``: also one rank's share of world W on one device (``profile --rank-of``, `profiling/cut.one_rank`),
shown as world ``1/W``: a world-W step without its collectives, where fewer than W GPUs are at hand; ``--worlds
none`` runs only those cases.

A case that does not fit the devices (e.g. the 40-layer model in bf16 on one H200) is reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax

from dsv41_jax import profile
from dsv41_jax.config import ConfigError
from dsv41_jax.planner import PlanRefused
from dsv41_jax.profile import UsageError
from dsv41_jax.profiling import floors
from dsv41_jax.profiling.args import comma_ints, rank_of_worlds, world_label
from sharding.mesh import request_host_devices

FORMATS = {"bf16": "dequantized", "fp4": "fp4"}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="dsv41_flash", help="tiny, dsv41_flash, or a config.json / checkpoint dir")
    p.add_argument("--layers", default="2,16,40", help="comma-separated cuts (K layers keeping the layer roles)")
    p.add_argument("--worlds", default="1,2,4", help="comma-separated worlds (those above the device count are "
                   "skipped); none: only the --rank-of cases")
    p.add_argument("--rows", default="2048,4096", help="comma-separated segment sizes")
    p.add_argument("--position", type=int, default=0, help="start position of the segment")
    p.add_argument("--formats", default="bf16,fp4", help="routed expert formats: bf16, fp4")
    p.add_argument("--dense-format", choices=("bf16", "fp8"), default="bf16",
                   help="dense matrices in bf16, or fp8 codes + block scales as the release stores them")
    p.add_argument("--gemm-inputs", choices=("exact", "fp8"), default="exact",
                   help="GEMM inputs as computed, or rounded to e4m3 + ue8m0 per 32 first (the release's numerics)")
    p.add_argument("--row-parallel-rows", default="0", metavar="N[,N2]",
                   help="comma-separated: segments of >= N rows run the HC mixes and norms row-parallel at world > 1 "
                        "(the planner's row_parallel_rows; 0 = off), one row per value (an A/B)")
    p.add_argument("--rank-of", default="", metavar="W[,W2]",
                   help="also time one rank's share of these worlds on one device (world column 1/W; no collectives)")
    p.add_argument("--impl", choices=("xla", "pallas"), default=None,
                   help="kernels (default: pallas on a GPU, xla elsewhere)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case (median reported)")
    p.add_argument("--bandwidth", type=float, default=None,
                   help=f"bytes/s of the read floor (default {floors.H200_BYTES_PER_S:.2g}, the H200's)")
    p.add_argument("--flops", type=float, default=None,
                   help=f"FLOP/s of the compute floor (default {floors.H200_BF16_FLOPS:.3g}, the H200's bf16 GEMM)")
    p.add_argument("--trace", default=None, metavar="DIR", help="trace directory (default: a new one under /tmp)")
    p.add_argument("--no-trace", action="store_true", help="no trace: no kernel share or per-part split")
    p.add_argument("--quick", action="store_true", help="first world, first cut, first segment size, bf16")
    p.add_argument("--json-out", default=None, metavar="FILE", help="also write the results as JSON to FILE")
    a = p.parse_args(argv)
    try:
        a.layers = comma_ints(a.layers, "--layers")
        a.worlds = [] if a.worlds == "none" else comma_ints(a.worlds, "--worlds")
        if not a.worlds and not any(w > 1 for w in rank_of_worlds(a.rank_of)):
            raise ValueError("--worlds none runs only the --rank-of cases: give --rank-of W (W > 1)")
        a.rows = comma_ints(a.rows, "--rows")
        a.row_parallel_rows = comma_ints(a.row_parallel_rows, "--row-parallel-rows", minimum=0)
        a.rank_of = rank_of_worlds(a.rank_of)
        a.formats = [f.strip() for f in a.formats.split(",") if f.strip()]
        bad = [f for f in a.formats if f not in FORMATS]
        if bad or not a.formats:
            raise ValueError(f"--formats takes bf16 and/or fp4, got {a.formats}")
        bad = [w for w in a.worlds if w not in (1, 2, 4, 8)]
        if bad:
            raise ValueError(f"--worlds takes 1, 2, 4 or 8, got {bad}")
        if a.position < 0 or a.repeats < 1:
            raise ValueError("--position must be >= 0 and --repeats >= 1")
    except ValueError as e:
        p.exit(2, f"bench_prefill: {e}\n")
    if a.quick:
        a.worlds, a.layers, a.rows, a.formats = a.worlds[:1], a.layers[:1], a.rows[:1], ["bf16"]
    return a


def run_case(a, *, world: int, layers: int, rows: int, fmt: str, trace_dir: Path | None,
             row_parallel_rows: int = 0, rank_of: int = 0) -> dict:
    """One prefill case through ``profile``: its step's time, floors (``profile``'s ``floor``) and trace split."""
    argv = ["--config", a.config, "--world", str(world), "--layers", str(layers), "--rows", str(rows),
            "--position", str(a.position), "--impl", a.impl, "--repeats", str(a.repeats),
            "--expert-format", FORMATS[fmt], "--dense-format", a.dense_format, "--gemm-inputs", a.gemm_inputs,
            "--compile-cache", "off",
            "--row-parallel-rows", str(row_parallel_rows),
            "--rank-of", str(rank_of)]
    if trace_dir is not None:
        argv += ["--trace", str(trace_dir)]
    step = profile.run(profile.parse_args(argv))["steps"][0]
    if step["error"]:
        raise RuntimeError(step["error"])
    fl = step["floor"]
    if a.bandwidth or a.flops:  # other rates than the H200's
        fl = floors.step_floor(fl["read_bytes"], step["flops"]["spec"],
                               bandwidth=a.bandwidth or floors.H200_BYTES_PER_S,
                               flop_rate=a.flops or floors.H200_BF16_FLOPS)
    t = step.get("trace") or {}
    return {"step_ms": step["median_s"] * 1e3, "read_ms": fl["read_s"] * 1e3, "compute_ms": fl["compute_s"] * 1e3,
            "floor_ms": fl["floor_s"] * 1e3, "ratio": step["median_s"] / fl["floor_s"],
            "tok_s": rows / step["median_s"], "weight_gb": fl["read_bytes"] / 1e9,
            "tflop": step["flops"]["spec"] / 1e12, "compile_s": step["compile_s"],
            "kernel_share": t["op_seconds"] / step["median_s"] if t.get("op_seconds") else None,
            "parts_ms": {p["part"]: p["seconds"] * 1e3 for p in t.get("parts", [])}}


HEADER = (f"{'world':>5} {'layers':>6} {'rows':>5} {'experts':>7} {'rp':>5} {'step ms':>8} {'read ms':>8} "
          f"{'comp ms':>8} {'ratio':>6} {'tok/s':>9} {'kernels':>7}  split (ms)")


def fmt_row(r: dict) -> str:
    head = f"{world_label(r):>5} {r['layers']:>6} {r['rows']:>5} {r['experts']:>7} {r['row_parallel_rows']:>5}"
    if "error" in r:
        return f"{head}  {r['error']}"
    share = "-" if r["kernel_share"] is None else format(r["kernel_share"], ".0%")
    split = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["parts_ms"].items(), key=lambda kv: -kv[1]))
    return (f"{head} {r['step_ms']:>8.4g} {r['read_ms']:>8.4g} {r['compute_ms']:>8.4g} {r['ratio']:>6.3g} "
            f"{r['tok_s']:>9.0f} {share:>7}  {split}")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    request_host_devices(max(a.worlds, default=1))  # CPU: simulated devices, before JAX starts
    if not a.no_trace:
        profile.one_kernel_per_op()

    devices = len(jax.devices())
    a.impl = a.impl or ("pallas" if jax.default_backend() == "gpu" else "xla")  # not runspec's: xla, not reference
    trace_root = None if a.no_trace else Path(a.trace or tempfile.mkdtemp(prefix="bench_prefill_"))
    dev = jax.devices()[0]
    print(f"bench_prefill {time.strftime('%Y-%m-%d')} · {dev.platform} {getattr(dev, 'device_kind', '')} · "
          f"jax {jax.__version__} · {a.config} · position {a.position:,} · impl {a.impl} · "
          f"median of {a.repeats}", flush=True)
    rows = []
    cases = [(w, 0) for w in a.worlds if w <= devices] + [(1, w) for w in a.rank_of if w > 1]
    for world, rank_of in cases:
        for layers in a.layers:
            for n in a.rows:
                for fmt, rp in [(f, rp) for f in a.formats for rp in a.row_parallel_rows if world > 1 or rp == 0]:
                    r = {"world": world, "rank_of": rank_of, "layers": layers, "rows": n, "experts": fmt,
                         "row_parallel_rows": rp}
                    name = f"w{world}" if not rank_of else f"rank_of{rank_of}"
                    folder = trace_root / f"{name}_l{layers}_r{n}_{fmt}_rp{rp}" if trace_root else None
                    try:
                        r.update(run_case(a, world=world, layers=layers, rows=n, fmt=fmt, trace_dir=folder,
                                          row_parallel_rows=rp, rank_of=rank_of))
                    except (UsageError, ConfigError, PlanRefused) as e:  # e.g. does not fit: said, skipped
                        r["error"] = str(e).splitlines()[0][:200]
                    except Exception as e:  # noqa: BLE001 - e.g. out of memory: reported, the grid goes on
                        r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    rows.append(r)
                    print(fmt_row(r), file=sys.stderr, flush=True)
    skipped = [w for w in a.worlds if w > devices]
    if skipped:
        print(f"worlds {skipped} skipped: {devices} devices present", file=sys.stderr)
    print(HEADER)
    for r in rows:
        print(fmt_row(r))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"device": str(getattr(dev, "device_kind", dev)), "jax": jax.__version__, "config": a.config,
                       "position": a.position, "impl": a.impl, "rows": rows}, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
