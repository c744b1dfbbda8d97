"""Routed-expert (x3gm) benchmark on one GPU: the op's implementations (``pallas_kernels.registry``: the Pallas
kernel, the XLA implementation's grouped ``ragged_dot``) vs the weight-read floor.

PYTHONPATH=. python benchmarks/bench_moe.py [--quick] [--xla] [--breakdown] [--json PATH]
PYTHONPATH=. python benchmarks/bench_moe.py --decode | --decode-sweep     # decode shapes only (1 and 8 rows)
PYTHONPATH=. python benchmarks/bench_moe.py --prefill-sweep [bf16|fp4]   # 2,048 rows only, block sizes swept

Shape (PLANNER.md §E): E = 384 experts, D = 5,120, top-6, 2,048 rows (12,288 pairs) at widths
F = 576 (world 4), 1,152 (world 2), 2,304 (world 1), bf16 and fp4 weights; decode: 1 and 8 rows. The floor is the
bytes of the touched experts' weights over 4.3 TB/s (the copy bandwidth measured on this H200 kind). Decode
shapes are timed as many calls in one program (a host dispatch a call, ~50 µs, would hide them). Prints GPU
correctness checks (every implementation, compiled, vs the f32 gather oracle) first and a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe import ExpertWeights, ops, routed_experts
from pallas_kernels.moe import kernel as kern
from pallas_kernels.moe.grouping import plan_tiles
from pallas_kernels.moe.kernel import KernelConfig
from pallas_kernels.moe.ops import check_blocks, default_config
from pallas_kernels.moe.reference import routed_experts_reference
from pallas_kernels.registry import IMPLEMENTATIONS

E, D, K, ROWS = 384, 5120, 6, 2048
LIMIT = 10.0
FLOOR_BANDWIDTH = 4.3e12  # B/s: device-to-device copy measured on this H200 kind (KINDS.md), the floor
INTERPRET = False  # True only for a CPU dry run of this script
QUICK_CHECKS = False
DECODE_CHECKS = False  # --decode / --decode-sweep: the decode-sized checks only
PREFILL_CHECKS = False  # --prefill-sweep: the checks of prefill-sized tiles with 128 act columns only


def timed(fn, *args, reps: int = 10) -> float:
    """Median seconds of ``reps`` synchronised calls after two warm-up calls."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed_chained(fn, *args, reps: int = 100) -> float:
    """Seconds a call when ``reps`` calls run in one program: a loop whose every iteration takes the small
    arguments through an optimization barrier with the previous result and selects on each of its outputs, so
    nothing is hoisted, fused or dropped (the weights stay loop constants, never copied). The device time of a
    call too short for a host dispatch per call (~50 µs) to be negligible (decode)."""
    leaves, tree = jax.tree.flatten(args)
    big = [leaf.nbytes > (64 << 20) for leaf in leaves]

    def looped(small, large):
        def call(small):
            small_it, large_it = iter(small), iter(large)
            return fn(*jax.tree.unflatten(tree, [next(large_it) if b else next(small_it) for b in big]))

        def body(_, small):
            small, out = jax.lax.optimization_barrier((small, call(small)))
            # a select on every output that XLA cannot prove constant keeps the whole call alive
            probe = sum(leaf.ravel()[0].astype(jnp.float32) for leaf in jax.tree.leaves(out))
            small[0] = jnp.where(probe == 1234.5, small[0] + 1, small[0])
            return small
        return jax.lax.fori_loop(0, reps, body, small)

    looped = jax.jit(looped)
    small = [leaf for leaf, b in zip(leaves, big) if not b]
    large = [leaf for leaf, b in zip(leaves, big) if b]
    jax.block_until_ready(looped(small, large))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(looped(small, large))
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def copy_bandwidth() -> float:
    """Bytes/s of an XLA elementwise pass over 4 GiB (read + write counted); printed as a sanity probe
    only (it read 2.95 TB/s where a plain copy reads 4.3), the floors use FLOOR_BANDWIDTH."""
    a = random_bf16(jax.random.key(0), (2 << 30,))
    f = jax.jit(lambda v: v * 2)
    seconds = timed(f, a)
    return 2 * a.nbytes / seconds


@partial(jax.jit, static_argnums=1)
def random_bf16(key, shape) -> jax.Array:
    """Random bf16 with magnitudes in [2^-7, 2^-6) and random signs (no zeros, no denormals).

    Built from 32-bit draws split in two under one jit, so the peak is twice the result, not more."""
    bits = jax.random.bits(key, (*shape[:-1], shape[-1] // 2), jnp.uint32)
    bits = jax.lax.bitcast_convert_type(bits, jnp.uint16).reshape(shape)
    bits = (bits & 0x807F) | 0x3C00  # sign, 7 mantissa bits, exponent 120
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def make_weights(key, width: int, fp4: bool, experts: int | None = None, dim: int | None = None):
    experts, dim = experts or E, dim or D
    k1, k2, k3, k4 = jax.random.split(key, 4)
    if not fp4:
        return ExpertWeights(w1=random_bf16(k1, (experts, width, dim)),
                             w3=random_bf16(k2, (experts, width, dim)),
                             w2=random_bf16(k3, (experts, dim, width)))

    def codes(k, shape):
        return jax.random.bits(k, shape, jnp.uint8)

    def scales(k, shape):
        return jax.random.randint(k, shape, 118, 122).astype(jnp.uint8)
    s1, s2, s3 = jax.random.split(k4, 3)
    return ExpertWeights.from_fp4(
        codes(k1, (experts, width, dim // 2)), scales(s1, (experts, width, dim // 32)),
        codes(k2, (experts, width, dim // 2)), scales(s2, (experts, width, dim // 32)),
        codes(k3, (experts, dim, width // 2)), scales(s3, (experts, dim, width // 32)))


def make_routing(key, rows: int, experts: int | None = None, hot: int | None = None):
    """Router-like top-k (distinct per row) of random scores; ``hot`` wins slot 0 on ~45% of rows."""
    experts = experts or E
    ks, kw, kh = jax.random.split(key, 3)
    scores = jax.random.normal(ks, (rows, experts))
    if hot is not None:
        boost = jnp.where(jax.random.uniform(kh, (rows,)) < 0.45, 100.0, 0.0)
        scores = scores.at[:, hot].add(boost)
    _, ids = jax.lax.top_k(scores, K)
    weights = jax.random.uniform(kw, (rows, K), minval=0.1, maxval=0.5)
    return ids.astype(jnp.int32), weights


def weight_bytes(weights: ExpertWeights, touched: int) -> int:
    total = sum(a.nbytes for a in jax.tree.leaves(weights))
    return total * touched // weights.num_experts


# ----------------------------------------------------------------------------------------------------

def pallas_fn(cfg: KernelConfig | None):
    return jax.jit(lambda x, ids, w, wts: routed_experts(
        x, ids, w, wts, swiglu_limit=LIMIT, impl="pallas", interpret=INTERPRET, config=cfg))


# the XLA implementation (the model's fallback): fp4 experts decoded in bf16 inside the jitted call
xla_fn = jax.jit(lambda x, ids, w, wts: routed_experts(x, ids, w, wts, swiglu_limit=LIMIT, impl="xla"))


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def gpu_checks(key) -> list[str]:
    """Every implementation, compiled, vs the f32 oracle on fresh inputs (bound 1e-2, NaN fails)."""
    cases = [  # name, rows, experts, width, dim, fp4, hot
        ("decode-1", 1, 64, 576, 1024, False, None),
        ("decode-64", 64, 64, 640, 1024, False, None),
        ("segment-700 skewed", 700, 64, 576, 1024, False, 3),
        ("segment-2048 w1152", 2048, 32, 1152, 512, False, None),
        ("fp4 decode-8", 8, 64, 576, 1024, True, None),
        ("fp4 segment-700 skewed", 700, 64, 512, 1024, True, 5),
        ("fp4 segment-300 w2304", 300, 16, 2304, 512, True, None),
        ("fp4 segment-700 w576", 700, 64, 576, 1024, True, 5),  # weights first, down chunk 64 (world 4's width)
    ]
    if QUICK_CHECKS:
        cases = [cases[i] for i in (2, 4, 5, 6)]
    if DECODE_CHECKS:
        cases = [cases[i] for i in (0, 1, 4)]
    elif PREFILL_CHECKS:
        cases = [cases[i] for i in (3, 5, 7)]
    lines = []
    ref_fn = jax.jit(routed_experts_reference, static_argnames="swiglu_limit")
    runs = {"pallas": pallas_fn(None), "xla": xla_fn}
    for name, rows, experts, width, dim, fp4, hot in cases:
        key, kx, kr, kw = jax.random.split(key, 4)
        x = jax.random.normal(kx, (rows, dim)).astype(jnp.bfloat16)
        ids, w = make_routing(kr, rows, experts, hot)
        wts = make_weights(kw, width, fp4, experts, dim)
        deq = wts.dequantized()
        ref = ref_fn(x, ids, w, deq.w1, deq.w3, deq.w2, swiglu_limit=LIMIT)
        for impl in IMPLEMENTATIONS:
            try:
                err = rel_err(runs[impl](x, ids, w, wts), ref)
            except Exception as exc:  # noqa: BLE001 - a failing check is reported, the others go on
                print(f"check {name} {impl}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
                err = float("nan")
            ok = err <= 1e-2
            lines.append(f"check {name:26s} {impl:6s} rel_err {err:.2e} {'ok' if ok else 'FAIL'}")
            print(lines[-1], flush=True)
    return lines


def piece_fns(cfg: KernelConfig):
    """The op's pieces for ``cfg``, each jitted: plan(ids), x_in(x) (fp4: chunks in plane order), gate_up(plan, x_in,
    weights), down(plan, act, weights), gather_sum(y_pairs, pair_pos, pair_valid, topk_weights)."""
    def gate_up(p, xx, ww):
        ww = ops.as_words(ww) if ww.is_fp4 else ww  # fp4 codes as the kernels read them (16-bit words)
        return kern.gate_up(p, xx, ww.w1, ww.w3, ww.w1_scale, ww.w3_scale, width=ww.width, permute_out=ww.is_fp4,
                            limit=LIMIT, cfg=cfg, interpret=INTERPRET)

    def down(p, a, ww):
        ww = ops.as_words(ww) if ww.is_fp4 else ww
        return kern.down(p, a, ww.w2, ww.w2_scale, dim=ww.dim, cfg=cfg, interpret=INTERPRET)

    return dict(
        plan=jax.jit(lambda i: plan_tiles(i, E, cfg.block_m)),
        x_in=lambda x, fp4: ops.plane_chunks(x, cfg.block_k) if fp4 else x,
        gate_up=jax.jit(gate_up),
        down=jax.jit(down),
        gather_sum=jax.jit(ops.weighted_gather_sum))


def breakdown(label, x, ids, w, wts) -> None:
    """Times of the pieces of the default path: plan, gate/up kernel, down kernel, gather-sum."""
    fns = piece_fns(default_config(ids.size, wts))
    plan_fn, gate_up, down, gather = fns["plan"], fns["gate_up"], fns["down"], fns["gather_sum"]
    plan = plan_fn(ids)
    xk = fns["x_in"](x, wts.is_fp4)
    act = gate_up(plan, xk, wts)
    y_pairs = down(plan, act, wts)
    parts = dict(plan=timed(plan_fn, ids), gate_up=timed(gate_up, plan, xk, wts),
                 down=timed(down, plan, act, wts),
                 gather_sum=timed(gather, y_pairs, plan.pair_pos, plan.pair_valid, w))
    print(f"breakdown {label}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in parts.items()), flush=True)


def bench_case(rows_out, label, width, fp4, rows, bandwidth, key, configs, with_xla, hot=None,
               do_breakdown=False):
    kx, kr, kw = jax.random.split(key, 3)
    x = jax.random.normal(kx, (rows, D)).astype(jnp.bfloat16)
    ids, w = make_routing(kr, rows, E, hot)
    wts = make_weights(kw, width, fp4)
    touched = int(jnp.unique(ids).size)
    nbytes = weight_bytes(wts, touched)
    floor = nbytes / bandwidth
    outs = {}
    for cfg_name, cfg in configs:
        try:
            fn = pallas_fn(cfg)
            seconds = timed(fn, x, ids, w, wts)
            outs[cfg_name] = fn(x, ids, w, wts)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile should not end the run
            print(f"{label} {cfg_name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        rows_out.append(dict(case=label, impl=f"pallas {cfg_name}", ms=seconds * 1e3, floor_ms=floor * 1e3,
                             gbps=nbytes / seconds / 1e9, touched=touched))
        print(rows_out[-1], flush=True)
    if do_breakdown and width == 576 and rows == ROWS:
        breakdown(label, x, ids, w, wts)
    if with_xla:
        seconds = timed(xla_fn, x, ids, w, wts, reps=3)
        xla_out = xla_fn(x, ids, w, wts)
        rows_out.append(dict(case=label, impl="xla", ms=seconds * 1e3, floor_ms=floor * 1e3,
                             gbps=nbytes / seconds / 1e9, touched=touched))
        print(rows_out[-1], flush=True)
        for cfg_name, out in outs.items():
            print(f"{label} pallas {cfg_name} vs xla rel_err {rel_err(out, xla_out):.2e}", flush=True)
    del wts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="world-4 width only, default config only")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--time-budget", type=float, default=1e9, help="skip sections started after S s")
    parser.add_argument("--xla", "--ragged", dest="xla", action="store_true",
                        help="also time the XLA implementation at 2,048 rows (--ragged: its former name)")
    parser.add_argument("--breakdown", action="store_true", help="time the pieces at F=576")
    parser.add_argument("--quick-checks", action="store_true", help="4 of the 7 GPU checks")
    parser.add_argument("--decode", action="store_true",
                        help="only decode shapes (1 and 8 rows): the decode-sized GPU checks, then the op and its "
                             "pieces with the default blocks, each timed as many calls in one program")
    parser.add_argument("--decode-sweep", action="store_true", help="--decode with the block sizes swept")
    parser.add_argument("--prefill-sweep", nargs="?", const="all", choices=("all", "bf16", "fp4"), default=None,
                        help="only 2,048 rows: bf16 at F = 2,304 and 1,152 (worlds 1, 2), fp4 at 1,152 and 576 "
                             "(worlds 2, 4): the pieces and the op, block sizes swept")
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        print("bench_moe.py needs a GPU (jax.default_backend() is %r)" % jax.default_backend(), file=sys.stderr)
        return 2
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
    key = jax.random.key(7)
    global QUICK_CHECKS, DECODE_CHECKS, PREFILL_CHECKS
    QUICK_CHECKS = args.quick_checks
    DECODE_CHECKS = args.decode or args.decode_sweep
    PREFILL_CHECKS = bool(args.prefill_sweep)
    checks = gpu_checks(key)
    if not (DECODE_CHECKS or PREFILL_CHECKS):
        probe = copy_bandwidth()
        print(f"XLA elementwise probe {probe / 1e12:.2f} TB/s; floors use {FLOOR_BANDWIDTH / 1e12:.1f} TB/s",
              flush=True)
    bandwidth = FLOOR_BANDWIDTH

    start = time.perf_counter()
    rows_out: list[dict] = []

    def section(label, width, fp4, rows, configs, with_xla=False, hot=None, seed=0):
        if time.perf_counter() - start > args.time_budget:
            print(f"skipped (time budget): {label}", flush=True)
            return
        bench_case(rows_out, label, width, fp4, rows, bandwidth, jax.random.key(seed), configs,
                   with_xla=with_xla, hot=hot, do_breakdown=args.breakdown)
        print(f"[{time.perf_counter() - start:.0f} s]", flush=True)

    if args.decode or args.decode_sweep:
        for rows, width, formats in ((8, 576, (True, False)), (1, 576, (True, False)), (1, 1152, (True, False)),
                                     (1, 2304, (True, False))):
            for fp4 in formats:
                sweeps = (DECODE_GATE_UP, DECODE_DOWN) if args.decode_sweep else ((), ())
                piece_sweep(rows_out, rows, width, fp4, bandwidth, jax.random.key(3), *sweeps)
                print(f"[{time.perf_counter() - start:.0f} s]", flush=True)
        return _report(args, rows_out, checks, bandwidth)
    if args.prefill_sweep:
        for width, fp4 in ((2304, False), (1152, False), (1152, True), (576, True)):
            if args.prefill_sweep != "all" and args.prefill_sweep != ("fp4" if fp4 else "bf16"):
                continue
            if fp4:  # fp4 act columns are ordered within BF chunks, so a BF is timed as a whole op (gate_up + down)
                sweeps = (PREFILL_GATE_UP_FP4, (), PREFILL_WHOLE_FP4)
            else:
                sweeps = (PREFILL_GATE_UP, PREFILL_DOWN, ())
            piece_sweep(rows_out, ROWS, width, fp4, bandwidth, jax.random.key(4), *sweeps)
            print(f"[{time.perf_counter() - start:.0f} s]", flush=True)
        return _report(args, rows_out, checks, bandwidth)

    fp4_base = default_config(ROWS * K, make_weights(key, 576, True, 2))  # the blocks of F = 576, D = 5,120
    fp4_configs = [("default", None)]
    if not args.quick:  # the blocks from before the decoded weights became the GEMMs' first operand
        fp4_configs.append(("weights-second", dataclasses.replace(
            fp4_base, fp4_weights_first=False, block_k=64, gate_up_stages=4, down_block_k=0)))
    section("2048 rows F=576 bf16", 576, False, ROWS, [("default", None)], with_xla=args.xla, seed=1)
    section("2048 rows F=576 fp4", 576, True, ROWS, fp4_configs, seed=2)
    for fp4 in (False, True):
        section(f"8 rows F=576 {'fp4' if fp4 else 'bf16'}", 576, fp4, 8, [("default", None)],
                with_xla=not fp4, seed=3)
    if not args.quick:
        for width, fp4 in ((2304, False), (2304, True), (1152, True), (1152, False)):
            section(f"2048 rows F={width} {'fp4' if fp4 else 'bf16'}", width, fp4, ROWS,
                    [("default", None)], seed=width + fp4)
        for fp4 in (False, True):
            section(f"2048 rows F=576 {'fp4' if fp4 else 'bf16'} skewed", 576, fp4, ROWS,
                    [("default", None)], hot=11, seed=5)
        section("2048 rows F=576 fp4", 576, True, ROWS,
                [("alu-decode", dataclasses.replace(fp4_base, fp4_decode="alu"))], seed=2)

    return _report(args, rows_out, checks, bandwidth)


def piece_sweep(rows_out, rows, width, fp4, bandwidth, key, gate_up_sweep=(), down_sweep=(),
                whole_sweep=()) -> None:
    """The op and its pieces at one shape, each timed as many calls in one program (``timed_chained``): the
    plan, ``gate_up`` with the default blocks and each of ``gate_up_sweep``'s (BF, BK, stages, warps),
    ``down`` likewise with ``down_sweep``'s (its K chunk, BN, stages, warps), the gather-sum, the whole op
    with the default blocks and with each of ``whole_sweep``'s overrides of them (``KernelConfig`` fields)."""
    kx, kr, kw = jax.random.split(key, 3)
    x = jax.random.normal(kx, (rows, D)).astype(jnp.bfloat16)
    ids, w = make_routing(kr, rows, E)
    wts = make_weights(kw, width, fp4)
    touched = int(jnp.unique(ids).size)
    per_matrix = weight_bytes(wts, touched) / 3 / bandwidth
    base = default_config(ids.size, wts)
    base_fns = piece_fns(base)
    label = f"{rows} rows F={width} {'fp4' if fp4 else 'bf16'}"
    plan = base_fns["plan"](ids)

    def add(part, cfg_name, seconds, floor):
        rows_out.append(dict(case=f"{label} {part}", impl=cfg_name, ms=seconds * 1e3, floor_ms=floor * 1e3,
                             gbps=0.0 if not floor else floor * bandwidth / seconds / 1e9, touched=touched))
        print(rows_out[-1], flush=True)

    def add_tiling(part, cfg, name, floor, fn, *args) -> bool:
        """Time ``fn(*args)`` for tiling ``cfg`` (refused unless its blocks divide: the pieces are called directly)
        and add its row; a tiling that is refused or fails to compile is reported and skipped (False)."""
        try:
            check_blocks(cfg, wts)
            add(part, name, timed_chained(fn, *args), floor)
            return True
        except Exception as exc:  # noqa: BLE001 - a failing piece is reported, the run goes on
            print(f"{label} {part} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            return False

    add("plan", "", timed_chained(base_fns["plan"], ids), 0.0)
    act = None
    first = (base.block_f, base.block_k, base.gate_up_stages, base.gate_up_warps)
    for bf, bk, st, wp in [first] + [c for c in gate_up_sweep if c != first]:
        cfg = dataclasses.replace(base, block_f=bf, block_k=bk, gate_up_stages=st, gate_up_warps=wp)
        fns = piece_fns(cfg)
        fn, xk = fns["gate_up"], fns["x_in"](x, fp4)
        if add_tiling("gate_up", cfg, f"bf{bf} bk{bk} s{st} w{wp}", 2 * per_matrix, fn, plan, xk, wts) and act is None:
            act = fn(plan, xk, wts)
    if act is None:
        print(f"{label}: the default gate_up failed; nothing more to time", flush=True)
        return
    down_first = (base.down_chunk, base.block_n, base.down_stages, base.down_warps)
    for bf, bn, st, wp in [down_first] + [c for c in down_sweep if c != down_first]:
        if fp4 and bf != base.down_chunk:  # fp4 act is in plane order per down chunk: act above fits base's
            continue
        cfg = dataclasses.replace(base, down_block_k=bf, block_n=bn, down_stages=st, down_warps=wp)
        add_tiling("down", cfg, f"bf{bf} bn{bn} s{st} w{wp}", per_matrix, piece_fns(cfg)["down"], plan, act, wts)
    y_pairs = base_fns["down"](plan, act, wts)
    add("gather-sum", "", timed_chained(base_fns["gather_sum"], y_pairs, plan.pair_pos, plan.pair_valid, w), 0.0)
    whole = pallas_fn(None)
    add("whole op", "default", timed_chained(whole, x, ids, w, wts), 3 * per_matrix)
    for fields in whole_sweep:
        cfg = dataclasses.replace(base, **fields)
        name = " ".join(f"{k}={v}" for k, v in fields.items())
        add_tiling("whole op", cfg, name, 3 * per_matrix, pallas_fn(cfg), x, ids, w, wts)


# (block_f, block_k, stages, warps) of gate_up and (K chunk, block_n, stages, warps) of down in --decode-sweep and
# --prefill-sweep (shared memory a bf16 gate_up stage: (BM·BK + 2·BF·BK)·2 B, a down stage (BM·BF + BN·BF)·2 B;
# 227 KB a block on the H200; a failing tiling is reported and skipped)
DECODE_GATE_UP = [(64, 64, 4, 4), (64, 128, 3, 4), (64, 128, 4, 4), (64, 256, 3, 4), (64, 256, 4, 4),
                  (32, 128, 3, 4), (32, 256, 3, 4), (32, 256, 4, 4), (64, 512, 2, 4), (32, 512, 2, 4),
                  (128, 256, 3, 4), (64, 256, 3, 8)]
DECODE_DOWN = [(64, 128, 4, 4), (64, 64, 4, 4), (64, 256, 4, 4), (64, 128, 2, 4), (64, 128, 3, 4), (64, 64, 2, 4),
               (64, 256, 3, 8)]
PREFILL_GATE_UP = [(64, 128, 3, 4), (128, 64, 4, 4), (128, 64, 5, 8), (64, 128, 4, 4), (128, 64, 3, 4)]
PREFILL_DOWN = [(64, 128, 4, 4), (128, 128, 4, 4), (128, 128, 3, 4), (128, 64, 4, 4), (128, 256, 2, 8),
                (128, 128, 2, 4)]
PREFILL_GATE_UP_FP4 = [(64, 64, 4, 4), (128, 64, 4, 4), (128, 64, 4, 8), (128, 64, 3, 8), (64, 128, 3, 4),
                       (64, 64, 3, 8), (32, 64, 4, 4), (128, 128, 2, 8)]
# the whole fp4 op: overrides of the default blocks (weights first, BK 128, down chunk 128 where it divides F):
# BM 32 (2,048 rows give ~32 pairs an expert), a wider K chunk, and the blocks before the weights came first
PREFILL_WHOLE_FP4 = [dict(block_m=32), dict(block_m=32, block_k=256), dict(block_k=256),
                     dict(fp4_weights_first=False, block_k=64, gate_up_stages=4, down_block_k=0)]


def _report(args, rows_out, checks, bandwidth) -> int:
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind,
                           bandwidth=bandwidth, checks=checks, rows=rows_out), fh, indent=1)
    print(f"\njax {jax.__version__} on {jax.devices()[0].device_kind}; floor at {bandwidth / 1e12:.1f} TB/s")
    print("\n".join(checks))
    print("| case | impl | ms | floor ms | x floor | GB/s | experts touched |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows_out:
        ratio = f"{r['ms'] / r['floor_ms']:.2f}" if r['floor_ms'] else "—"
        print(f"| {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | "
              f"{ratio} | {r['gbps']:.0f} | {r['touched']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
