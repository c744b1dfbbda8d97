"""The HC mix's product (`hc.hc_mix`: streams [rows, S·D] bf16 · fn [24, S·D]ᵀ f32, MODEL.md §B.4) at few rows,
both ways `norms.f32_matmul` can run it, alone and inside a loop over stacked layers as the scanned units run it.

    PYTHONPATH=. python benchmarks/bench_hc_product.py            # H200: rows 1 .. 128, K = 4 × 5,120
    PYTHONPATH=. python benchmarks/bench_hc_product.py --quick    # CPU smoke run (tests/test_bench_hc_product.py)

Why: in the 40-layer model's 16-row prefill segment the product took ~0.6 ms a call (41 of 68 ms of kernels,
docs/BENCHMARKS.md "Scanned layers read their experts in place"), where a 1-row product is a few µs. The programs
compile with the engine's options (`compiler.options`): with XLA's Triton GEMMs on (jax's default) the f32 way
costs ~14 µs at every row count, which hid the cuBLAS case the model runs. Under
``norms.SPLIT_MIN_ROWS`` rows `f32_matmul` runs an IEEE-f32 GEMM at HIGHEST ("f32"), from it the exact split
into three bf16 GEMMs ("split"); this prints both at each row count so the threshold can be set by measurement.

Per row count and way: µs a product alone (``alone``: many products in one program, the weight a loop constant)
and a layer's product inside a ``lax.scan`` over ``--layers`` stacked weights (``in loop``: the weight sliced a
layer an iteration, as in a scanned unit), the read floor (weight + rows ÷ 4.3 TB/s) and the ratio of each.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp

from dsv41_jax import compiler
from dsv41_jax.model import norms

FLOOR_BANDWIDTH = 4.3e12  # B/s, the H200 copy rate the other benchmarks' floors use
WAYS = {"f32": 1 << 30, "split": 1}  # norms.SPLIT_MIN_ROWS that makes f32_matmul take each way


def _per_call(run, *args, reps: int) -> float:
    """Seconds a call of ``run(*args)`` (a jitted program doing ``reps`` calls), compiled with the engine's options
    (`compiler.options`: on a GPU no Triton GEMMs, so the product is cuBLAS's as in the model), best of three after
    a warm-up."""
    run = run.lower(*args).compile(compiler.options())
    jax.block_until_ready(run(*args))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(run(*args))
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def alone(x, fn, reps: int):
    """``reps`` products in one program; each takes the previous one's x through a barrier (nothing hoisted)."""
    def body(_, carry):
        x, acc = jax.lax.optimization_barrier(carry)
        return x, acc + jnp.sum(norms.f32_matmul(x, fn))  # all of y: a slice of it would shrink the GEMM
    return jax.jit(lambda x: jax.lax.fori_loop(0, reps, body, (x, jnp.float32(0))))


def in_loop(x, fns, reps: int):
    """``reps`` passes of a scan over the stacked weights fns [L, 24, K], one product a layer."""
    def layer(carry, fn):
        x, acc = jax.lax.optimization_barrier(carry)
        return (x, acc + jnp.sum(norms.f32_matmul(x, fn))), None

    def body(_, carry):
        return jax.lax.scan(layer, carry, fns)[0]
    return jax.jit(lambda x: jax.lax.fori_loop(0, reps, body, (x, jnp.float32(0))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,6,8,16,32,64,128", help="comma-separated row counts")
    p.add_argument("--width", type=int, default=4 * 5120, help="K = hc_mult × hidden size")
    p.add_argument("--outputs", type=int, default=24, help="the mix's outputs (hc_mult · (2 + hc_mult))")
    p.add_argument("--layers", type=int, default=12, help="stacked layers of the in-loop case")
    p.add_argument("--reps", type=int, default=200, help="products a timed program does")
    p.add_argument("--quick", action="store_true", help="CPU smoke sizes: rows 1,16, K 256, 2 layers, 3 reps")
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.width, a.layers, a.reps = "1,16", 256, 2, 3
    try:
        rows = [int(r) for r in a.rows.split(",") if r.strip()]
        if not rows or min(rows) < 1 or a.width < 1 or a.outputs < 1 or a.layers < 1 or a.reps < 1:
            raise ValueError
    except ValueError:
        print(f"bench_hc_product: --rows takes positive integers, sizes must be >= 1, got {a.rows!r}",
              file=sys.stderr)
        return 2
    dev = jax.devices()[0]
    print(f"bench_hc_product {time.strftime('%Y-%m-%d %H:%M')} · {getattr(dev, 'device_kind', dev.platform)} · "
          f"jax {jax.__version__} · K {a.width} · {a.outputs} outputs · {a.layers} stacked layers in the loop")
    key = jax.random.key(0)
    fns = jax.random.normal(key, (a.layers, a.outputs, a.width), jnp.float32) * 0.01
    print(f"{'rows':>5} {'way':>6} {'alone us':>9} {'in loop us':>11} {'floor us':>9} {'alone/fl':>9} {'loop/fl':>8}")
    saved = norms.SPLIT_MIN_ROWS
    try:
        for r in rows:
            x = jax.random.normal(jax.random.fold_in(key, r), (r, a.width), jnp.float32).astype(jnp.bfloat16)
            floor = (a.outputs * a.width * 4 + r * a.width * 2) / FLOOR_BANDWIDTH
            for way, threshold in WAYS.items():
                norms.SPLIT_MIN_ROWS = threshold   # read when the product is traced
                t_alone = _per_call(alone(x, fns[0], a.reps), x, reps=a.reps)
                t_loop = _per_call(in_loop(x, fns, a.reps), x, reps=a.reps * a.layers)
                print(f"{r:>5} {way:>6} {t_alone * 1e6:>9.2f} {t_loop * 1e6:>11.2f} {floor * 1e6:>9.2f} "
                      f"{t_alone / floor:>9.1f} {t_loop / floor:>8.1f}", flush=True)
    finally:
        norms.SPLIT_MIN_ROWS = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
