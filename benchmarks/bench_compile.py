"""Compile time of the decode and prefill steps, scanned vs unrolled layers.

    python benchmarks/bench_compile.py                        # a GPU: the 40-layer flash model, world 1
    python benchmarks/bench_compile.py --layers 8 --rows 256  # a cut
    python benchmarks/bench_compile.py --config tiny --impl xla --rows 16   # CPU smoke run
    python benchmarks/bench_compile.py --modes scanned --steps decode       # one step only (an option's A/B)

Weights are abstract (shapes with shardings, `profiling.build.build_model(abstract=True)`): nothing is allocated,
so the whole model compiles on one device. Per step and mode it prints the seconds of tracing + lowering
(`jax.jit(...).lower`) and of XLA's compile, their sum against the bound (decode ≤ 15 s, prefill ≤ 25 s)
and the ratio, the program's size (custom calls = Pallas kernels, fusions, while loops), and what a second run
takes: the executable loaded from `compiler`'s store (a temporary directory; bound ≤ 3 s). The first compile
is always cold (the store starts empty; JAX's own cache is off).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import compile_cache, compiler, runspec
from dsv41_jax.config import load_named
from dsv41_jax.profiling import build
from dsv41_jax.profiling.cut import cut_layers

BOUND_S = {"decode": 15.0, "prefill": 25.0}
SECOND_RUN_BOUND_S = 3.0


def parse(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/bench_compile.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="dsv41_flash")
    p.add_argument("--layers", type=int, default=None, help="cut to K layers (default: all)")
    p.add_argument("--rows", type=int, default=2048, help="prefill rows")
    p.add_argument("--impl", choices=("xla", "pallas"), default="pallas")
    p.add_argument("--modes", default="scanned,unrolled", help="comma-separated: scanned, unrolled")
    p.add_argument("--steps", default="decode,prefill", help="comma-separated: decode, prefill")
    p.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an XLA compile option on top of compiler.options() (repeatable; true/false, integers), to "
                        "A/B one, e.g. xla_gpu_autotune_level=0; XLA refuses names its build does not know")
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    try:
        a.xla_options = dict(_option(text) for text in a.xla_option)
    except ValueError as e:
        p.error(str(e))
    modes = [m for m in a.modes.split(",") if m]
    if not modes or any(m not in ("scanned", "unrolled") for m in modes):
        p.error(f"--modes must name scanned and/or unrolled, got {a.modes!r}")
    a.steps = [x for x in a.steps.split(",") if x]
    if not a.steps or any(x not in BOUND_S for x in a.steps):
        p.error(f"--steps must name decode and/or prefill, got {','.join(a.steps)!r}")
    if a.rows < 1 or (a.layers is not None and a.layers < 1):
        p.error("--rows and --layers must be at least 1")
    return a, modes


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--xla-option takes KEY=VALUE, got {text!r}")
    low = value.strip().lower()
    if low in ("true", "false"):
        return key.strip(), low == "true"
    try:
        return key.strip(), int(value)
    except ValueError:
        return key.strip(), value


def compile_step(cfg, options, rows: int, xla_options: dict | None = None) -> dict:
    """Trace + lower and compile one step of ``rows`` rows (1 = decode) over abstract weights, then load it back
    from the executable store as a second run would (``load_s``; None when the store is off)."""
    model, mesh = runspec.device_model(cfg, runspec.RunSpec(), options, abstract=True)
    cache = build.build_cache(cfg, mesh, batch=1, position=0, rows=rows, dtype=options.dtype, abstract=True)
    graphdef, state = nnx.split(model)

    def step(state, cache, ids):
        logits, cache = nnx.merge(graphdef, state)(ids, cache, logit_rows=jnp.full((1,), rows - 1, jnp.int32))
        return cache, jnp.argmax(logits, -1)

    ids = jax.ShapeDtypeStruct((1, rows), jnp.int32)
    args, identity = (state, cache, ids), f"bench_compile {rows} {compiler.graph_digest(graphdef)}"
    cold, second = {}, {}
    kw = dict(identity=identity, extra_options=xla_options or None)
    compiled, _ = compiler.compile(jax.jit(step, donate_argnums=1), args, timings=cold, **kw)
    compiler.compile(jax.jit(step, donate_argnums=1), args, timings=second, **kw)  # a second run
    text = compiled.as_text()
    return {"trace_s": cold["lower_s"], "compile_s": cold["compile_s"], "load_s": second.get("load_s"),
            "custom_calls": text.count("custom-call("), "fusions": text.count(" fusion("),
            "while": text.count(" while(")}


def main(argv=None) -> int:
    a, modes = parse(argv)
    with tempfile.TemporaryDirectory() as store:
        compile_cache.enable(store)  # an empty store: the first compile is cold, the second loads
        return _run(a, modes)


def _run(a, modes) -> int:
    cfg = load_named(a.config)
    cfg = cut_layers(cfg, a.layers or cfg.num_hidden_layers)
    base = runspec.model_options(runspec.RunSpec(impl=a.impl))
    units = cfg.layer_units()
    groups = sum(len(step) == 2 for step in cfg.layer_steps())
    print(f"{a.config}: {cfg.num_hidden_layers} layers, {len(units)} units "
          f"({sum(len(u) > 1 for u in units)} stacked, {groups} group scans) · impl {a.impl} · "
          f"{jax.devices()[0].device_kind} · "
          f"{'extra XLA options ' + str(a.xla_options) + ' · ' if a.xla_options else ''}"
          f"jax {jax.__version__}", flush=True)
    print(f"{'step':10s} {'mode':9s} {'trace s':>8s} {'compile s':>10s} {'total s':>8s} {'bound s':>8s} "
          f"{'ratio':>6s} {'2nd run s':>10s} {'bound s':>8s} {'calls':>6s} {'fusions':>8s} {'while':>6s}", flush=True)
    rows_out = []
    for kind, rows in [(k, 1 if k == "decode" else a.rows) for k in ("decode", "prefill") if k in a.steps]:
        for mode in modes:
            r = compile_step(cfg, dataclasses.replace(base, scan_layers=mode == "scanned"), rows, a.xla_options)
            total = r["trace_s"] + r["compile_s"]
            second = f"{r['load_s']:10.1f}" if r["load_s"] is not None else f"{'-':>10s}"
            print(f"{kind:10s} {mode:9s} {r['trace_s']:8.1f} {r['compile_s']:10.1f} {total:8.1f} "
                  f"{BOUND_S[kind]:8.1f} {total / BOUND_S[kind]:6.2f} {second} {SECOND_RUN_BOUND_S:8.1f} "
                  f"{r['custom_calls']:6d} {r['fusions']:8d} {r['while']:6d}", flush=True)
            rows_out.append({"step": kind, "rows": rows, "mode": mode, **r, "bound_s": BOUND_S[kind],
                             "second_run_bound_s": SECOND_RUN_BOUND_S})
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"config": a.config, "layers": cfg.num_hidden_layers, "xla_options": a.xla_options,
                       "units": [list(u) for u in units],
                       "impl": a.impl, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
