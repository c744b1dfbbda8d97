"""Compile time of the decode and prefill steps, scanned vs unrolled layers (issue 14, "Layers scanned").

    python benchmarks/bench_compile.py                        # H200: the 40-layer flash model, world 1
    python benchmarks/bench_compile.py --layers 8 --rows 256  # a cut
    python benchmarks/bench_compile.py --config tiny --impl xla --rows 16   # CPU smoke run

Weights are abstract (shapes with shardings, `profiling.build.build_model(abstract=True)`): nothing is allocated,
so the whole model compiles on one device. Per step and mode it prints the seconds of tracing + lowering
(`jax.jit(...).lower`) and of XLA's compile, their sum against the issue's bound (decode ≤ 15 s, prefill ≤ 25 s)
and the ratio, and the program's size (custom calls = Pallas kernels, fusions, while loops). The persistent
compilation cache is not used (``jax_enable_compilation_cache`` off), so every figure is a cold compile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import compiler
from dsv41_jax.config import load_named
from dsv41_jax.model import ModelOptions
from dsv41_jax.profiling import build
from dsv41_jax.profiling.cut import cut_layers

BOUND_S = {"decode": 15.0, "prefill": 25.0}


def parse(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/bench_compile.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="dsv41_flash")
    p.add_argument("--layers", type=int, default=None, help="cut to K layers (default: all)")
    p.add_argument("--rows", type=int, default=2048, help="prefill rows")
    p.add_argument("--impl", choices=("xla", "pallas"), default="pallas")
    p.add_argument("--modes", default="scanned,unrolled", help="comma-separated: scanned, unrolled")
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if not modes or any(m not in ("scanned", "unrolled") for m in modes):
        p.error(f"--modes must name scanned and/or unrolled, got {a.modes!r}")
    if a.rows < 1 or (a.layers is not None and a.layers < 1):
        p.error("--rows and --layers must be at least 1")
    return a, modes


def compile_step(cfg, options, rows: int) -> dict:
    """Trace + lower and compile one step of ``rows`` rows (1 = decode) over abstract weights."""
    model, mesh = build.build_model(cfg, 1, options, abstract=True)
    cache = build.build_cache(cfg, mesh, batch=1, position=0, rows=rows, dtype=options.dtype, abstract=True)
    graphdef, state = nnx.split(model)

    def step(state, cache, ids):
        logits, cache = nnx.merge(graphdef, state)(ids, cache, logit_rows=jnp.full((1,), rows - 1, jnp.int32))
        return cache, jnp.argmax(logits, -1)

    ids = jax.ShapeDtypeStruct((1, rows), jnp.int32)
    start = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=1).lower(state, cache, ids)
    traced = time.perf_counter()
    text = lowered.compile(compiler.options()).as_text()
    done = time.perf_counter()
    return {"trace_s": traced - start, "compile_s": done - traced, "custom_calls": text.count("custom-call("),
            "fusions": text.count(" fusion("), "while": text.count(" while(")}


def main(argv=None) -> int:
    a, modes = parse(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    cfg = load_named(a.config)
    cfg = cut_layers(cfg, a.layers or cfg.num_hidden_layers)
    base = ModelOptions(dtype="bfloat16", attention_impl=a.impl, moe_impl=a.impl, indexer_impl=a.impl,
                        hc_impl=a.impl)
    units = cfg.layer_units()
    print(f"{a.config}: {cfg.num_hidden_layers} layers, {len(units)} units "
          f"({sum(len(u) > 1 for u in units)} scanned runs) · impl {a.impl} · {jax.devices()[0].device_kind} · "
          f"jax {jax.__version__}", flush=True)
    print(f"{'step':10s} {'mode':9s} {'trace s':>8s} {'compile s':>10s} {'total s':>8s} {'bound s':>8s} "
          f"{'ratio':>6s} {'calls':>6s} {'fusions':>8s} {'while':>6s}", flush=True)
    rows_out = []
    for kind, rows in (("decode", 1), ("prefill", a.rows)):
        for mode in modes:
            r = compile_step(cfg, dataclasses.replace(base, scan_layers=mode == "scanned"), rows)
            total = r["trace_s"] + r["compile_s"]
            print(f"{kind:10s} {mode:9s} {r['trace_s']:8.1f} {r['compile_s']:10.1f} {total:8.1f} "
                  f"{BOUND_S[kind]:8.1f} {total / BOUND_S[kind]:6.2f} {r['custom_calls']:6d} {r['fusions']:8d} "
                  f"{r['while']:6d}", flush=True)
            rows_out.append({"step": kind, "rows": rows, "mode": mode, **r, "bound_s": BOUND_S[kind]})
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"config": a.config, "layers": cfg.num_hidden_layers, "units": [list(u) for u in units],
                       "impl": a.impl, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
