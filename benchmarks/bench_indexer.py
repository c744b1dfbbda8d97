"""Benchmark: the indexer's scores + top-k (k = 512), XLA path vs the fused Pallas kernel (bf16 and e4m3 MMA).

Shapes: 32 index heads × 128 dims; segments of 2,048 rows and decode windows of 1 / 8 / 64 rows whose
last row sits at position 0 / 100K / 300K / 1M (a 2,048-row segment "at 1M" ends at 1,048,576), ratio 1 and 2
(N = ⌈end / r⌉ keys). q and keys are drawn on a grid exact in bf16 and e4m3 (multiples of 1/2 within ±6, the
fp4 rounding points' kind of values), w ~ N(0, 1). Prints one table: median time, useful TFLOP/s
(2·H·d per visible (row, key)) and its fraction of the measured bf16 GEMM rate (668 TFLOP/s on this
workplace's H200), speed-up over the XLA path, and whether the kernel's picks equal the XLA path's (rows whose
sorted picks are identical / rows compared; at most 128 evenly spaced rows are compared, so the XLA path is run
even where it is too slow to time).

    PYTHONPATH=. python benchmarks/bench_indexer.py [--quick] [--json out.json]
        [--block-rows 1|16|32|64] [--key-tile 32|64|128] [--splits S] [--group 4|8|16] [--warps 4|8]
        [--stages 2|3|4]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.indexer import kernel as indexer_kernel
from pallas_kernels.indexer.kernel import fp8_exact, index_topk_pallas
from pallas_kernels.indexer.tiling import launch_rows
from pallas_kernels.indexer.xla import index_topk_xla, map_row_blocks

HEADS, HEAD_DIM, TOPK, CONTEXT = 32, 128, 512, 1_048_576
SCORE_BUDGET = 256 << 20          # the model's XLA-path row block (dsv41_jax.model.indexer.SCORE_BUDGET_BYTES)
XLA_TIMED_MAX = 2048 * 320_000    # rows × keys above which the XLA path is only run for the equality sample
EQUALITY_ROWS = 128


def grid_values(key, shape):
    """Multiples of 1/2 within ±6 (exact in bf16 and, after a power-of-two scale, in e4m3)."""
    return jnp.clip(jnp.round(jax.random.normal(key, shape, jnp.float32) * 4) / 2, -6, 6)


def make_inputs(rows: int, position: int, ratio: int, seed: int = 0):
    start = min(position, CONTEXT - rows)
    n = -(-(start + rows) // ratio)
    ks = jax.random.split(jax.random.key(seed), 3)
    q = grid_values(ks[0], (1, rows, HEADS, HEAD_DIM))
    w = jax.random.normal(ks[1], (1, rows, HEADS), jnp.float32) * HEADS**-0.5
    keys = grid_values(ks[2], (1, n, HEAD_DIM)).astype(jnp.bfloat16)
    positions = (start + jnp.arange(rows, dtype=jnp.int32))[None, :]
    return q, w, keys, positions


def useful_flops(positions, ratio: int, n: int) -> float:
    visible = np.minimum((np.asarray(positions) + 1) // ratio, n)
    return 2.0 * HEADS * HEAD_DIM * float(visible.sum())


def time_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))                       # compile + warm
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


@functools.lru_cache(maxsize=None)
def xla_fn(rows: int, n: int, ratio: int):
    block = rows if rows * 4 * n * (HEADS + 2) <= SCORE_BUDGET else max(1, SCORE_BUDGET // (4 * n * (HEADS + 2)))
    return jax.jit(lambda q, w, k, p: index_topk_xla(q, w, k, p, ratio=ratio, k=TOPK, rows_per_block=block)[0])


TILING: dict = {}   # --block-rows / --key-tile / --splits / --group / --warps / --stages (None: kernel defaults)


def kernel_rows(rows: int, n: int) -> int:
    """Rows per launch, as the model launches the kernel (its workspace within SCORE_BUDGET)."""
    return launch_rows(1, rows, n, TOPK, budget=SCORE_BUDGET, heads=HEADS, head_dim=HEAD_DIM)


@functools.lru_cache(maxsize=None)
def kernel_fn(rows: int, n: int, ratio: int, score_dtype: str):
    def launch(k, q, w, p):
        return index_topk_pallas(q, w, k, p, ratio=ratio, k=TOPK, score_dtype=score_dtype, **TILING)[0]

    return jax.jit(lambda q, w, k, p: map_row_blocks(functools.partial(launch, k), (q, w, p),
                                                     kernel_rows(rows, n)))


def equal_rows(picks, q, w, keys, positions, ratio: int) -> str:
    """Rows (of an evenly spaced sample) whose sorted picks equal the XLA path's."""
    rows = q.shape[1]
    sample = np.unique(np.linspace(0, rows - 1, min(rows, EQUALITY_ROWS)).astype(int))
    sel = lambda x: x[:, sample]
    ref = xla_fn(len(sample), keys.shape[1], ratio)(sel(q), sel(w), keys, sel(positions))
    got = np.sort(np.asarray(picks)[:, sample], -1)
    same = (got == np.sort(np.asarray(ref), -1)).all(-1).sum()
    return f"{same}/{len(sample)}"


def bench_one(rows: int, position: int, ratio: int, repeats: int, gemm: float) -> list[dict]:
    q, w, keys, positions = make_inputs(rows, position, ratio)
    n = keys.shape[1]
    flops = useful_flops(positions, ratio, n)
    base = {"rows": rows, "position": position, "ratio": ratio, "keys": n, "flops": flops}
    out = []
    xla_ms = None
    if rows * n <= XLA_TIMED_MAX:
        try:
            xla_ms = time_ms(xla_fn(rows, n, ratio), (q, w, keys, positions), max(1, repeats // 2))
        except Exception as exc:  # noqa: BLE001 - an out-of-memory or compile failure is reported, not fatal
            print(f"  xla {rows}×{n}: failed: {str(exc).splitlines()[0][:160]}", flush=True)
    out.append({**base, "impl": "xla", "ms": xla_ms, "equal": "ref"})
    exact8 = bool(fp8_exact(q, keys))
    for dtype in ("bfloat16", "float8_e4m3fn"):
        row = {**base, "impl": f"pallas {'bf16' if dtype == 'bfloat16' else 'e4m3'}", "ms": None, "equal": "-"}
        if dtype != "bfloat16" and not exact8:
            row["equal"] = "inexact"
            out.append(row)
            continue
        try:
            fn = kernel_fn(rows, n, ratio, dtype)
            row["ms"] = time_ms(fn, (q, w, keys, positions), repeats)
            row["equal"] = equal_rows(fn(q, w, keys, positions), q, w, keys, positions, ratio)
        except Exception as exc:  # noqa: BLE001 - a failing case is reported, the grid goes on
            print(f"  {row['impl']} {rows}×{n}: failed: {str(exc).splitlines()[0][:200]}", flush=True)
            row["equal"] = "failed"
        out.append(row)
    for r in out:
        r["tflops"] = None if r["ms"] is None else flops / (r["ms"] * 1e-3) / 1e12
        r["speedup"] = None if (r["ms"] is None or xla_ms is None) else xla_ms / r["ms"]
        ms = "-" if r["ms"] is None else f"{r['ms']:.3f} ms"
        print(f"  rows {rows:>5} pos {position:>9,} r{ratio} keys {n:>9,} {r['impl']:<12} {ms:>12}  "
              f"equal {r['equal']}  (kernel: {kernel_rows(rows, n)} rows a launch)", flush=True)
    return out


def print_table(results, gemm: float):
    print(f"\nuseful FLOPs = 2·{HEADS}·{HEAD_DIM} per visible (row, key); % of the bf16 GEMM rate {gemm:.0f} TFLOP/s")
    header = ("rows", "position", "r", "keys", "impl", "ms", "TFLOP/s", "%GEMM", "vs XLA", "equal")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in results:
        t = r["tflops"]
        cells = (r["rows"], f"{r['position']:,}", r["ratio"], f"{r['keys']:,}", r["impl"],
                 "-" if r["ms"] is None else f"{r['ms']:.3f}", "-" if t is None else f"{t:.0f}",
                 "-" if t is None else f"{100 * t / gemm:.0f}%",
                 "-" if r["speedup"] is None else f"{r['speedup']:.1f}x", r["equal"])
        print("| " + " | ".join(str(c) for c in cells) + " |")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="positions 0 and 300K, ratio 2, 2,048 and 1 rows")
    p.add_argument("--positions", default=None, help="comma-separated (default 0,100000,300000,1048576)")
    p.add_argument("--rows", default=None, help="comma-separated row counts (default 2048,1,8,64)")
    p.add_argument("--ratios", default=None, help="comma-separated (default 1,2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gemm-tflops", type=float, default=668.0, help="the measured bf16 GEMM rate (TFLOP/s)")
    p.add_argument("--json", help="write the rows to this file")
    for flag, key in (("--block-rows", "block_rows"), ("--key-tile", "key_tile"), ("--splits", "splits"),
                      ("--group", "group"), ("--warps", "num_warps"), ("--stages", "num_stages")):
        p.add_argument(flag, type=int, default=None, dest=key, help=f"kernel tiling: {key} (default: kernel.tiling)")
    p.add_argument("--score-pass", choices=("triton", "mosaic"), default=None,
                   help="the maxima pass of prefill launches (kernel.SCORE_PASS; mosaic: sm_90 only, its own "
                        "tiling: the --block-rows/--key-tile/--splits/--warps/--stages options apply to triton)")
    a = p.parse_args(argv)
    quick = a.quick
    try:
        a.positions = [int(x) for x in (a.positions or ("0,300000" if quick else "0,100000,300000,1048576")).split(",")]
        a.rows = [int(x) for x in (a.rows or ("2048,1" if quick else "2048,1,8,64")).split(",")]
        a.ratios = [int(x) for x in (a.ratios or ("2" if quick else "1,2")).split(",")]
    except ValueError:
        p.exit(2, "error: --positions, --rows and --ratios take comma-separated integers\n")
    if (any(not 0 <= x <= CONTEXT for x in a.positions) or any(not 1 <= x <= 2048 for x in a.rows)
            or any(r < 1 for r in a.ratios) or a.repeats < 1):
        p.exit(2, f"error: positions in 0..{CONTEXT:,}, rows in 1..2,048, ratios and repeats ≥ 1\n")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    device = jax.devices()[0]
    print(f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, device {device.device_kind}, "
          f"jax {jax.__version__}, backend {jax.default_backend()}", flush=True)
    if jax.default_backend() != "gpu":
        print("error: this benchmark needs a GPU (the kernel only runs compiled there)", file=sys.stderr)
        return 2
    keys = ("block_rows", "key_tile", "splits", "group", "num_warps", "num_stages")
    TILING.update({k: getattr(args, k) for k in keys if getattr(args, k) is not None})
    if args.score_pass:
        indexer_kernel.SCORE_PASS = args.score_pass
    results = []
    for rows in args.rows:
        for position in args.positions:
            for ratio in args.ratios:
                results += bench_one(rows, position, ratio, args.repeats, args.gemm_tflops)
    print_table(results, args.gemm_tflops)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.device_kind, "jax": jax.__version__, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
