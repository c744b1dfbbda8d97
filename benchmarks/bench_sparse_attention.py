"""Benchmark: fused sparse prefill attention, the op's implementations (``pallas_kernels.registry``): the Pallas
kernel per tiling vs the XLA implementation (jitted), both checked against the float32 gather oracle.

Shapes: T = 2,048 query rows, Dh = 512, 128 window + 512 compressed keys per row, local heads
64/32/16/8, one sequence at a deep position. Prints the measured ceilings of the device, then one table row
per (heads, implementation, tiling): median time, useful TFLOP/s, bytes/s (two counts, see below), and the
error against the float32 oracle (``reference.py``) on the same inputs.

    PYTHONPATH=. python benchmarks/bench_sparse_attention.py [--heads 64,32,16,8] [--sweep] [--json out.json]

Byte counts: "floor" = each input read once and the output written once (q, o, window, topk, the pool rows
the topk touches) -> compared with the copy ceiling; "keys" = the key rows every program streams from L2/HBM
(T * ceil(H/BMQ) * keys * Dh * 2), the traffic the kernel actually asks the memory system for.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sparse_attention.kernel import lanes_for, sparse_attention_pallas
from pallas_kernels.sparse_attention.ops import sparse_attention
from pallas_kernels.sparse_attention.reference import sparse_attention_reference


@dataclasses.dataclass(frozen=True)
class Shape:
    rows: int = 2048
    heads: int = 16
    head_dim: int = 512
    window: int = 128
    topk: int = 512
    pool: int = 32768
    first_pos: int = 100_000
    batch: int = 1


@dataclasses.dataclass(frozen=True)
class Tiling:
    key_tile: int | None = None    # None: the kernel's default for the head tile
    num_warps: int | None = None
    num_stages: int | None = None
    head_tile: int | None = None

    def label(self) -> str:
        head = "" if self.head_tile is None else f" bmq{self.head_tile}"
        if self.key_tile is None:
            return "default" + head
        return f"kt{self.key_tile} w{self.num_warps} s{self.num_stages}{head}"


# The first entry of each list is the kernel's default for that MMA row count (kernel.default_tiling).
SWEEPS = {
    16: (Tiling(64, 4, 2), Tiling(32, 4, 2), Tiling(64, 8, 2), Tiling(16, 4, 3)),
    32: (Tiling(64, 4, 2), Tiling(32, 4, 2), Tiling(16, 4, 3)),
}


def make_inputs(shape: Shape, key):
    """Random inputs on the device (sparse_attention's positional arguments)."""
    b, t, h, d = shape.batch, shape.rows, shape.heads, shape.head_dim
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.bfloat16)
    pool = jax.random.normal(ks[1], (b, shape.pool, d), jnp.bfloat16)
    topk = jnp.sort(jax.random.randint(ks[2], (b, t, shape.topk), 0, shape.pool, jnp.int32), axis=-1)
    window = jax.random.normal(ks[3], (b, t + shape.window - 1, d), jnp.bfloat16)
    window_start = jnp.full((b,), shape.first_pos - (shape.window - 1), jnp.int32)
    q_pos = jnp.broadcast_to(shape.first_pos + jnp.arange(t, dtype=jnp.int32), (b, t))
    sinks = jax.random.normal(ks[4], (h,), jnp.float32)
    return q, pool, topk, window, window_start, q_pos, sinks


def time_ms(fn, arg_sets, repeats: int, sample_s: float = 0.02) -> float:
    """Median time of one call of fn, in ms.

    One jitted call runs fn on every input set (distinct inputs, so nothing is cached or merged). Each sample
    queues enough such calls back to back to last about `sample_s`, then waits once, so the host's
    synchronisation cost (~0.1-0.5 ms here) is spread over many kernels; median over `repeats` samples."""
    batched = jax.jit(lambda sets: [fn(*args) for args in sets])
    jax.block_until_ready(batched(arg_sets))
    start = time.perf_counter()
    jax.block_until_ready(batched(arg_sets))
    calls = max(1, min(200, int(sample_s / max(time.perf_counter() - start, 1e-6))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = [batched(arg_sets) for _ in range(calls)]
        jax.block_until_ready(outs)
        samples.append((time.perf_counter() - start) / (calls * len(arg_sets)))
    return statistics.median(samples) * 1e3


# This workplace's H200 measurements (PLANNER.md §G): device copy ~4.3 TB/s, 8192^3 bf16 GEMM ~790 TFLOP/s.
# Percentages use the larger of these and what this script measures, so they are never flattering.
H200_CEILINGS = {"copy_TBps": 4.3, "gemm_TFLOPs": 790.0}


def measure_ceilings(repeats: int) -> dict:
    """Device copy bandwidth (bytes read + written) and a large bf16 matrix product, on random data."""
    x = jax.random.normal(jax.random.key(1), (2**29,), jnp.bfloat16)                # 1 GiB
    copy_ms = time_ms(lambda a: a + jnp.bfloat16(1), [(x,)], repeats)
    a, b = (jax.random.normal(jax.random.key(i), (8192, 8192), jnp.bfloat16) for i in (2, 3))
    gemm_ms = time_ms(lambda p, q: p @ q, [(a, b)], repeats)
    return {"copy_TBps": 2 * x.nbytes / copy_ms / 1e9, "gemm_TFLOPs": 2 * 8192**3 / gemm_ms / 1e9}


def work_counts(shape: Shape, arg_sets, head_tile: int) -> dict:
    keys = shape.topk + shape.window
    flops = 4 * shape.batch * shape.rows * shape.heads * shape.head_dim * keys        # QK and PV
    q, _, topk = arg_sets[0][:3]
    touched = int(jnp.unique(topk).size) * shape.head_dim * 2
    floor = (2 * q.nbytes + arg_sets[0][3].nbytes + topk.nbytes + touched)
    programs = shape.batch * shape.rows * -(-shape.heads // head_tile)
    return {"flops": flops, "floor_bytes": floor, "key_bytes": programs * keys * shape.head_dim * 2}


def relative_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if not np.isfinite(out).all():
        return float("nan")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def bench_heads(shape: Shape, tilings, num_sets: int, repeats: int, with_xla: bool) -> list[dict]:
    arg_sets = [make_inputs(shape, jax.random.key(100 + i)) for i in range(num_sets)]
    kw = dict(window_size=shape.window, scale=shape.head_dim ** -0.5)
    upcast = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in arg_sets[0]]
    ref = jax.jit(lambda *a: sparse_attention_reference(*a, **kw))(*upcast)
    rows = []
    for tiling in tilings:
        head_tile = tiling.head_tile or min(32, shape.heads)
        fn = lambda *a, t=tiling: sparse_attention_pallas(
            *a, **kw, head_tile=t.head_tile, key_tile=t.key_tile, num_warps=t.num_warps,
            num_stages=t.num_stages)
        try:
            err = relative_error(jax.jit(fn)(*arg_sets[0]), ref)
            ms = time_ms(fn, arg_sets, repeats)
        except Exception as exc:  # noqa: BLE001 - a tiling that does not compile is reported, not fatal
            print(f"  H={shape.heads} {tiling.label()}: failed: {str(exc).splitlines()[0][:200]}", flush=True)
            continue
        rows.append({"heads": shape.heads, "impl": "pallas", "tiling": tiling.label(), "ms": ms, "rel_err": err,
                     **work_counts(shape, arg_sets, head_tile)})
        print(f"  H={shape.heads} pallas {tiling.label()}: {ms:.3f} ms, err {err:.1e}", flush=True)
    if with_xla:
        fn = lambda *a: sparse_attention(*a, **kw, impl="xla")
        ms = time_ms(fn, arg_sets[:2], max(3, repeats // 4))
        rows.append({"heads": shape.heads, "impl": "xla", "tiling": "-", "ms": ms,
                     "rel_err": relative_error(jax.jit(fn)(*arg_sets[0]), ref),
                     **work_counts(shape, arg_sets, shape.heads)})
        print(f"  H={shape.heads} xla: {ms:.3f} ms", flush=True)
    return rows


def print_table(rows, ceilings):
    print(f"\npercentages against: copy {ceilings['copy_TBps']:.2f} TB/s, "
          f"bf16 GEMM {ceilings['gemm_TFLOPs']:.0f} TFLOP/s")
    header = ("heads", "impl", "tiling", "ms", "TFLOP/s", "%GEMM", "floor TB/s", "%copy", "keys TB/s",
              "vs xla", "rel err")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    ref_ms = {r["heads"]: r["ms"] for r in rows if r["impl"] != "pallas"}
    for r in rows:
        sec = r["ms"] * 1e-3
        tflops = r["flops"] / sec / 1e12
        floor = r["floor_bytes"] / sec / 1e12
        speedup = f"{ref_ms[r['heads']] / r['ms']:.1f}x" if r["heads"] in ref_ms else "-"
        cells = (r["heads"], r["impl"], r["tiling"], f"{r['ms']:.3f}", f"{tflops:.0f}",
                 f"{100 * tflops / ceilings['gemm_TFLOPs']:.0f}%", f"{floor:.2f}",
                 f"{100 * floor / ceilings['copy_TBps']:.0f}%", f"{r['key_bytes'] / sec / 1e12:.2f}", speedup,
                 f"{r['rel_err']:.1e}")
        print("| " + " | ".join(str(c) for c in cells) + " |")


def bench_decode(heads_list, repeats: int) -> None:
    """Decode shapes (T = 1): the kernel against the jitted XLA implementation, all heads of one shard."""
    print("\ndecode (T = 1, 512 + 128 keys): | heads | batch | pallas ms | xla ms |")
    for heads in heads_list:
        for batch in (1, 16):
            shape = Shape(rows=1, heads=heads, batch=batch)
            sets = [make_inputs(shape, jax.random.key(7 + i)) for i in range(4)]
            kw = dict(window_size=shape.window, scale=shape.head_dim ** -0.5)
            kernel_ms = time_ms(lambda *a: sparse_attention_pallas(*a, **kw), sets, repeats)
            xla_ms = time_ms(lambda *a: sparse_attention(*a, **kw, impl="xla"), sets, repeats)
            print(f"| {heads} | {batch} | {kernel_ms:.3f} | {xla_ms:.3f} |", flush=True)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="64,32,16,8", help="comma-separated local head counts")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--pool", type=int, default=32768, help="compressed pool entries per sequence")
    parser.add_argument("--sweep", action="store_true", help="time several tilings, not only the default")
    parser.add_argument("--sets", type=int, default=4, help="distinct input sets rotated while timing")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-xla", "--no-reference", dest="no_xla", action="store_true",
                        help="skip the XLA implementation's row (--no-reference: its former name)")
    parser.add_argument("--decode", action="store_true", help="also time decode shapes (T = 1)")
    parser.add_argument("--json", help="write all rows and ceilings to this file")
    args = parser.parse_args(argv)
    try:
        args.heads = [int(h) for h in args.heads.split(",")]
    except ValueError:
        parser.exit(2, f"error: --heads must be comma-separated integers, got {args.heads!r}\n")
    if any(not 1 <= h <= 64 for h in args.heads) or args.rows < 1 or args.pool < 1 or args.sets < 1:
        parser.exit(2, "error: heads must be in 1..64; rows, pool and sets must be positive\n")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = jax.devices()[0]
    print(f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, device {device.device_kind}, "
          f"jax {jax.__version__}, backend {jax.default_backend()}", flush=True)
    if jax.default_backend() != "gpu":
        print("error: this benchmark needs a GPU (the kernel only runs compiled there)", file=sys.stderr)
        return 2
    ceilings = measure_ceilings(args.repeats)
    print(f"measured ceilings: {ceilings}", flush=True)
    if "H200" in device.device_kind:
        ceilings = {k: max(v, H200_CEILINGS[k]) for k, v in ceilings.items()}
    rows = []
    for heads in args.heads:
        tilings = list(SWEEPS[lanes_for(min(32, heads))]) if args.sweep else [Tiling()]
        shape = Shape(rows=args.rows, heads=heads, pool=args.pool)
        rows += bench_heads(shape, tilings, args.sets, args.repeats, not args.no_xla)
    print_table(rows, ceilings)
    if args.decode:
        bench_decode([64, 16], args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.device_kind, "jax": jax.__version__, "ceilings": ceilings, "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
