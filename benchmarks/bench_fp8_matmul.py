"""Block-scaled fp8 matmul benchmark on one GPU: the op's implementations (``pallas_kernels.registry``: the Pallas
kernel reading e4m3 codes + ue8m0 scales, the XLA implementation's dequantise-then-dot) and a bf16 dense dot of the
same shape (the model's dense GEMM today), against their floors.

PYTHONPATH=. python benchmarks/bench_fp8_matmul.py [--world 4|1] [--rows 1,8,32,2048] [--impls pallas,xla,bf16]
                                                   [--no-variants] [--no-checks] [--json PATH] [--dry-run]

Shapes: one rank's dense projections of the release (configs/dsv41_flash.json, splits of sharding/rules.py) at
world 4 (default) or 1. Floors: bytes (weights in the row's format + x + y) over 4.3 TB/s (the copy bandwidth
measured on this H200 kind) and 2·M·N·K over 790 TFLOP/s (its bf16 GEMM rate); the ratio is the time over the
larger. Each call is timed inside one program that runs it many times over several copies of the weights (more
bytes than the 60 MB L2, so every call reads HBM), each call's result through an optimization barrier with the
next call's input (serial, nothing hoisted or fused away). ``--dry-run``: small shapes in interpret mode on CPU (the
script's own check). Prints GPU checks of the Pallas kernel against the float64 oracle first and the tables last.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8_matmul import Fp8Weight, fp8_matmul
from pallas_kernels.fp8_matmul.ops import DECODE_ROWS, KernelConfig, _check_config, _k_splits, default_config
from pallas_kernels.fp8_matmul.reference import dequantize, error_bound, grouped_matmul

READ_BANDWIDTH = 4.3e12  # B/s: device-to-device copy measured on this H200 kind (KINDS.md)
BF16_RATE = 790e12       # FLOP/s: bf16 GEMM on random data measured on this H200 kind (KINDS.md)
L2_BYTES = 60 << 20
HIGHEST = jax.lax.Precision.HIGHEST


@dataclass(frozen=True)
class Projection:
    name: str
    n: int
    k: int
    groups: int = 1
    per_layer: float = 1.0  # calls a layer (the indexer's wq_b: 8 of the 40 layers)


def projections(world: int) -> list[Projection]:
    """One rank's dense fp8 projections: heads, output groups and shared-expert columns split W ways."""
    w = world
    return [
        Projection("wq_a", 1280, 5120),
        Projection(f"wq_b/{w}", 32768 // w, 1280),
        Projection("wkv", 512, 5120),
        Projection(f"wo_a/{w}", 8192 // w, 4096, groups=8 // w),
        Projection(f"wo_b/{w}", 5120, 8192 // w),
        Projection(f"shared.w1,w3/{w}", 2304 // w, 5120, per_layer=2.0),
        Projection(f"shared.w2/{w}", 5120, 2304 // w),
        Projection("indexer.wq_b", 4096, 1280, per_layer=8 / 40),
    ]


DRY_RUN_PROJECTIONS = [Projection("small", 256, 512), Projection("grouped", 256, 256, groups=2)]


def variants(rows: int, p: Projection) -> dict[str, KernelConfig]:
    """Kernel configs compared with the default at a size (the last table); those that do not tile are left out."""
    base = default_config(rows, p.n, p.k, p.groups)
    if rows <= DECODE_ROWS:
        def resplit(cfg):  # the default's rule for the K split, at the variant's blocks
            return dataclasses.replace(cfg, k_splits=_k_splits(p.k // cfg.block_k, p.n // cfg.block_n))
        found = {"split 1": dataclasses.replace(base, k_splits=1),
                 "alu decode": dataclasses.replace(base, decode="alu"),
                 "block_n 32": resplit(dataclasses.replace(base, block_n=32)),
                 "block_n 128": resplit(dataclasses.replace(base, block_n=128)),
                 "block_k 128": resplit(dataclasses.replace(base, block_k=128))}
    else:
        found = {"block_m 64, 4 warps": dataclasses.replace(base, block_m=64, num_warps=4),
                 "block_k 128": dataclasses.replace(base, block_k=128),
                 "alu decode": dataclasses.replace(base, decode="alu"),
                 "4 stages": dataclasses.replace(base, num_stages=4)}
    fits = {}
    for label, cfg in found.items():
        try:
            _check_config(cfg, p.n, p.k, p.groups)
        except ValueError:
            continue
        if cfg != base:
            fits[label] = cfg
    return fits


# ------------------------------------------------------------------------------------------------- inputs
@jax.jit
def _random_codes(key, shape_like):
    """Finite e4m3 code bytes (no NaN codes 0x7F / 0xFF), uniform over magnitudes and signs."""
    k1, k2 = jax.random.split(key)
    mag = jax.random.randint(k1, shape_like.shape, 0, 127, jnp.int32)
    sign = jax.random.bernoulli(k2, 0.5, shape_like.shape).astype(jnp.int32) << 7
    return jax.lax.bitcast_convert_type((mag | sign).astype(jnp.uint8), jnp.float8_e4m3fn)


def make_weights(key, p: Projection, copies: int) -> tuple[Fp8Weight, list[jax.Array]]:
    """``copies`` random fp8 weights as one stack [C, N, K] (read at a row) and their bf16 forms as C arrays."""
    k1, k2 = jax.random.split(key)
    codes = _random_codes(k1, jax.ShapeDtypeStruct((copies, p.n, p.k), jnp.uint8))
    scales = jax.random.randint(k2, (copies, -(-p.n // 32), -(-p.k // 32)), 118, 125, jnp.int32).astype(jnp.uint8)
    stack = Fp8Weight(codes, scales)
    return stack, [_bf16_copy(stack, c) for c in range(copies)]


@functools.partial(jax.jit, static_argnums=1)
def _bf16_copy(stack: Fp8Weight, copy: int) -> jax.Array:
    return stack.dequantized(jnp.bfloat16)[copy]


def copies_for(p: Projection) -> int:
    """Copies of the weights so that a round of calls reads 3× the L2 in fp8 (at most 48 call sites a round)."""
    return int(min(48, max(4, math.ceil(3 * L2_BYTES / (p.n * p.k)))))


# ------------------------------------------------------------------------------------------------- the calls
def bf16_dot(x, w, groups: int):
    """The model's dense GEMM today (``model.norms.linear`` / the grouped ``wo_a`` einsum): bf16 operands, f32
    accumulation at HIGHEST, a bf16 result."""
    if groups == 1:
        y = jnp.einsum("mi,oi->mo", x, w, preferred_element_type=jnp.float32, precision=HIGHEST)
    else:
        n, k = w.shape
        y = jnp.einsum("mgi,goi->mgo", x.reshape(x.shape[0], groups, k), w.reshape(groups, n // groups, k),
                       preferred_element_type=jnp.float32, precision=HIGHEST).reshape(x.shape[0], n)
    return y.astype(x.dtype)


def chained_program(call, copies: int, iters: int):
    """A program running ``call(x, j)`` for j = 0..C-1, ``iters`` times; each result through an optimization
    barrier with the next call's x (serial, nothing hoisted), a probe of every result kept (nothing dropped)."""
    def program(x, weights):
        def body(_, carry):
            x, acc = carry
            probes = []
            for j in range(copies):
                y = call(x, weights, j)
                x, y = jax.lax.optimization_barrier((x, y))
                probes.append(y.reshape(-1)[0].astype(jnp.float32))
            acc = acc + sum(probes)
            return jnp.where(acc == 1234.5, x + 1, x), acc
        return jax.lax.fori_loop(0, iters, body, (x, jnp.float32(0)))
    return jax.jit(program)


@dataclass
class Case:
    projection: Projection
    rows: int
    impl: str        # "pallas" | "xla" | "bf16"
    label: str       # the config's name ("default" or a variant)
    cfg: KernelConfig | None
    calls: int = 0
    compiled: object = None
    args: tuple = ()
    error: str = ""
    seconds: float = float("nan")


def build(case: Case, x, stack: Fp8Weight, bf16: list, interpret: bool) -> Case:
    """Lower and compile the case's chained program (run in a worker thread: XLA's compile releases the GIL)."""
    p = case.projection
    copies = len(bf16)
    per_round = 240 if case.rows <= 64 else 60
    iters = max(2, math.ceil(per_round / copies))
    if interpret:
        iters = 1
    if case.impl == "bf16":
        call = lambda x, ws, j: bf16_dot(x, ws[j], p.groups)
        weights = bf16
    else:
        if case.impl == "pallas" and case.cfg is None:
            case.cfg = default_config(case.rows, p.n, p.k, p.groups)
        cfg = case.cfg
        call = lambda x, ws, j: fp8_matmul(x, ws, groups=p.groups, row=j, impl=case.impl, config=cfg,
                                           interpret=interpret)
        weights = stack
    try:
        program = chained_program(call, copies, iters)
        case.compiled = program.trace(x, weights).lower().compile()
        case.args, case.calls = (x, weights), copies * iters
    except Exception as e:  # noqa: BLE001 - one failed variant must not lose the table
        case.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return case


def run(case: Case, repeats: int = 3) -> None:
    if case.error:
        return
    try:
        jax.block_until_ready(case.compiled(*case.args))
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(case.compiled(*case.args))
            best = min(best, time.perf_counter() - start)
        case.seconds = best / case.calls
    except Exception as e:  # noqa: BLE001
        case.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def floors(p: Projection, rows: int, fp8: bool) -> tuple[float, float]:
    """(read floor, compute floor) seconds: weights in the format + x + y; 2·M·N·K bf16 FLOPs."""
    weight_bytes = p.n * p.k * (1 if fp8 else 2) + (-(-p.n // 32) * -(-p.k // 32) if fp8 else 0)
    io_bytes = 2 * rows * (p.groups * p.k + p.n)
    return (weight_bytes + io_bytes) / READ_BANDWIDTH, 2 * rows * p.n * p.k / BF16_RATE


# ------------------------------------------------------------------------------------------------- checks
def check(p: Projection, rows: int, stack: Fp8Weight, key, interpret: bool) -> str:
    """The compiled Pallas kernel (f32 result) on layer 0 of the stack against the float64 oracle's bound."""
    x = (jax.random.normal(key, (rows, p.groups * p.k), jnp.float32)).astype(jnp.bfloat16)
    fn = jax.jit(lambda x, w: fp8_matmul(x, w, groups=p.groups, row=0, out_dtype=jnp.float32,
                                         interpret=interpret))
    y = np.asarray(fn(x, stack), np.float64)
    w64 = dequantize(np.asarray(stack.codes[0]).view(np.uint8), np.asarray(stack.scales[0]))
    x64 = np.asarray(x, np.float64)
    ref = grouped_matmul(x64, w64, p.groups)
    worst = float(np.max(np.abs(y - ref) / error_bound(x64, w64, groups=p.groups)))
    rel = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    ok = np.all(np.isfinite(y)) and worst <= 1.0 and rel <= 1e-4
    return f"{'ok  ' if ok else 'FAIL'} {p.name:18s} M={rows:5d}  max |err|/bound {worst:.2e}  rel {rel:.2e}"


# ------------------------------------------------------------------------------------------------- report
def short(cfg: KernelConfig) -> str:
    """m16 n64 k256 ×10 w4 s3 (cvt): blocks, K splits, warps, stages, decode."""
    split = f" ×{cfg.k_splits}" if cfg.k_splits > 1 else ""
    return (f"m{cfg.block_m} n{cfg.block_n} k{cfg.block_k}{split} w{cfg.num_warps} s{cfg.num_stages}"
            + (f" {cfg.decode}" if cfg.decode != "cvt" else ""))


def table(cases: list[Case], title: str, bf16_cases: list[Case] | None = None) -> list[str]:
    bf16_time = {(c.projection.name, c.rows): c.seconds for c in (bf16_cases or cases) if c.impl == "bf16"}
    lines = [f"## {title}", "",
             "| projection | N×K (groups) | M | impl | config | time µs | read floor µs | compute floor µs | "
             "ratio | bf16 dot / this |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        p = c.projection
        read, compute = floors(p, c.rows, c.impl != "bf16")
        shape = f"{p.n}×{p.k}" + (f" ({p.groups})" if p.groups > 1 else "")
        label = c.label + (f": {short(c.cfg)}" if c.cfg else "")
        if c.error:
            lines.append(f"| {p.name} | {shape} | {c.rows} | {c.impl} | {label} | failed: {c.error} | "
                         f"{read * 1e6:.2f} | {compute * 1e6:.2f} | | |")
            continue
        speed = bf16_time.get((p.name, c.rows), float("nan")) / c.seconds
        lines.append(f"| {p.name} | {shape} | {c.rows} | {c.impl} | {label} | {c.seconds * 1e6:.2f} | "
                     f"{read * 1e6:.2f} | {compute * 1e6:.2f} | {c.seconds / max(read, compute):.2f}× | "
                     f"{speed:.2f}× |")
    return lines


def layer_sums(cases: list[Case], rows_list: list[int]) -> list[str]:
    """Σ calls-a-layer × time over the projections, per M and implementation (the indexer's share averaged)."""
    lines = ["## A layer's dense projections (Σ calls a layer × time; floors: the larger of read and compute)", "",
             "| M | pallas µs | xla µs | bf16 dot µs | fp8 floor µs | bf16 floor µs | pallas / fp8 floor |",
             "|---|---|---|---|---|---|---|"]
    for rows in rows_list:
        total = {impl: 0.0 for impl in ("pallas", "xla", "bf16")}
        floor8 = floor16 = 0.0
        for c in cases:
            if c.rows != rows or c.label != "default":
                continue
            total[c.impl] += c.projection.per_layer * c.seconds
            if c.impl == "pallas":
                floor8 += c.projection.per_layer * max(floors(c.projection, rows, True))
                floor16 += c.projection.per_layer * max(floors(c.projection, rows, False))
        lines.append(f"| {rows} | {total['pallas'] * 1e6:.1f} | {total['xla'] * 1e6:.1f} | {total['bf16'] * 1e6:.1f} | "
                     f"{floor8 * 1e6:.1f} | {floor16 * 1e6:.1f} | {total['pallas'] / floor8:.2f}× |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4, choices=(1, 2, 4, 8))
    ap.add_argument("--rows", default="1,8,32,2048")
    ap.add_argument("--impls", default="pallas,xla,bf16", help="which rows to time (bf16: the dense dot)")
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--threads", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--json")
    ap.add_argument("--dry-run", action="store_true", help="small shapes, interpret mode (CPU)")
    args = ap.parse_args()
    interpret = args.dry_run
    rows_list = [int(r) for r in args.rows.split(",")]
    projs = DRY_RUN_PROJECTIONS if args.dry_run else projections(args.world)
    started = time.time()
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", flush=True)

    key = jax.random.key(0)
    weights, cases = {}, []
    for i, p in enumerate(projs):
        copies = 2 if args.dry_run else copies_for(p)
        weights[p.name] = make_weights(jax.random.fold_in(key, i), p, copies)
        for rows in rows_list:
            for impl in args.impls.split(","):
                cases.append(Case(p, rows, impl, "default", None))
    variant_cases = []
    if not args.no_variants:
        chosen = [p for p in projs if p.name.split("/")[0] in ("wq_a", "shared.w1,w3", "wo_b", "small")]
        for p in chosen:
            for rows in sorted({rows_list[0], rows_list[-1]}):
                variant_cases += [Case(p, rows, "pallas", label, cfg) for label, cfg in variants(rows, p).items()]
    xs = {}
    for p in projs:
        for rows in rows_list:
            xs[p.name, rows] = (jax.random.normal(jax.random.fold_in(key, 1000 + rows), (rows, p.groups * p.k),
                                                  jnp.float32)).astype(jnp.bfloat16)
    header = [f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, world {args.world} (one rank), "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", ""]
    check_lines: list[str] = []

    def phase(phase_cases: list[Case], with_checks: bool) -> None:
        """Compile the cases (and the checks) in worker threads, then time them one by one."""
        t0 = time.time()
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.threads)) as pool:
            futures = [pool.submit(build, c, xs[c.projection.name, c.rows], *weights[c.projection.name],
                                   interpret) for c in phase_cases]
            checks = []
            if with_checks:
                checks = [pool.submit(check, p, rows, weights[p.name][0], jax.random.key(rows), interpret)
                          for p in projs for rows in sorted({rows_list[0], 8, rows_list[-1]})]
            concurrent.futures.wait(futures)
            for f in checks:
                try:
                    check_lines.append(f.result())
                except Exception as e:  # noqa: BLE001
                    check_lines.append(f"FAIL check: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                print(check_lines[-1], flush=True)
        print(f"compiled {len(phase_cases)} programs in {time.time() - t0:.0f} s", flush=True)
        for c in phase_cases:
            run(c)
            print(f"  {c.projection.name} M={c.rows} {c.impl} {c.label}: "
                  f"{c.error or f'{c.seconds * 1e6:.2f} µs'}", flush=True)
        write_json(cases + variant_cases)

    def write_json(done: list[Case]) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump([dict(projection=c.projection.name, n=c.projection.n, k=c.projection.k,
                                groups=c.projection.groups, rows=c.rows, impl=c.impl, label=c.label,
                                cfg=dataclasses.asdict(c.cfg) if c.cfg else None, seconds=c.seconds,
                                error=c.error) for c in done], f, indent=1)

    phase(cases, with_checks=not args.no_checks)
    out = header + table(cases, "The op and a bf16 dot of the same shape") + [""]
    out += layer_sums(cases, rows_list) + [""]
    print("\n".join(out), flush=True)
    if variant_cases:
        phase(variant_cases, with_checks=False)
        compared = {(c.projection.name, c.rows) for c in variant_cases}
        defaults = [c for c in cases if c.impl == "pallas" and (c.projection.name, c.rows) in compared]
        rows_of = sorted(defaults + variant_cases, key=lambda c: (c.projection.name, c.rows, c.label != "default"))
        print("\n".join(table(rows_of, "Kernel variants (pallas; the default as in the first table)", cases)),
              flush=True)
    print(f"total {time.time() - started:.0f} s")
    failed = [line for line in check_lines if not line.startswith("ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
