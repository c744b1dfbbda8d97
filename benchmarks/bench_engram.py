"""Engram cost on one device, in one run (`MODEL.md` §B.12: D 5120, 4 streams, 24 hash columns × 256, fp8 table
rows + ue8m0 scales, dequantised bf16 ``wkv``):

1. **device tables** (world 1): a full-width engram layer with random device-side weights (release table size by
   default), median ms for a prefill segment and a decode step, against ``--prefill-step-ms`` /
   ``--decode-step-ms`` (default: a 2-layer profile's step times, docs/BENCHMARKS.md): the share it adds; and
   its ``wkv`` GEMM alone, held bf16 vs held as stored (fp8) and decoded in the step.
2. **host hashing** per call (`dsv41_jax.engram.Hasher`, median of many calls): a decode step's hash with the
   history terms prefetched on the worker thread during the (simulated) device step, and inline.
3. **host tables** (``--engram-tables host``): two memory-mapped tables of ``--host-table-rows`` rows in a
   temporary file (page-cached after the first touch; the release's 98 GB tables do not fit this machine's
   disk, and a random 264-byte row costs the same once the table is far beyond the caches), the gather rate
   (rows/s) and ms of a 2,048-row prefill call and a one-row decode call, the host→device copy, the layer on
   gathered rows, and a 2,048-row prefill of ``--segments`` segments run serially (gather, copy, step, wait)
   and overlapped (gather of segment k+1 while the device runs segment k, as the engine does through async
   dispatch): ms per step each way. A decode step's gather needs the token just sampled, so it is not
   overlapped: its cost is hash + gather + copy.

    python benchmarks/bench_engram.py                       # release table size on the device (98 GB)
    python benchmarks/bench_engram.py --table-rows 50000000 # a smaller device table (gather cost ~ the same)

The bounds: ≤ 5 % of a 2,048-row prefill step, ≤ 0.1 ms per decode step (device tables).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import engram
from dsv41_jax.config import load_named
from dsv41_jax.model.engram import Engram, EngramInput


def build(cfg, rows: int, tables: str = "device") -> tuple[Engram, object]:
    """Layer 1's engram with ``rows`` table rows; weights random on the device (no host copy, no f32 table)."""
    cfg = cfg.replace(engram_num_embeddings=(rows, *cfg.engram_num_embeddings[1:]))
    abstract = nnx.eval_shape(lambda: Engram(cfg, 1, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), tables=tables))
    graphdef, state = nnx.split(abstract)
    keys = iter(jax.random.split(jax.random.key(0), 8))

    def fill(key, shape, dtype):
        if dtype == jnp.float8_e4m3fn:  # random e4m3 codes from random bytes (NaN codes 0x7f/0xff cleared)
            raw = jax.random.bits(key, shape, jnp.uint8) & 0x7E
            return jax.lax.bitcast_convert_type(raw, jnp.float8_e4m3fn)
        if dtype == jnp.uint8:
            return jnp.full(shape, 120, jnp.uint8)
        return (jax.random.normal(key, shape, jnp.float32) * shape[-1] ** -0.5).astype(dtype)

    fill = jax.jit(fill, static_argnums=(1, 2))  # one fused program a leaf: no full-size temporaries
    state = jax.tree.map(lambda x: fill(next(keys), tuple(x.shape), jnp.dtype(x.dtype)), state)
    return nnx.merge(graphdef, state), cfg


CHAIN = 20  # calls dispatched back to back per timed sample (a decode step runs the layer inside its program)


def median_ms(fn, *args, repeats: int) -> float:
    """Device time per call: median over ``repeats`` samples of CHAIN chained calls, read once each, so the
    host's dispatch and sync (~0.05–0.08 ms a call, which a chained decode step does not pay per layer) are
    not counted in a sub-0.1 ms figure."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(CHAIN):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / CHAIN)
    return float(np.median(times)) * 1e3


def host_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def device_tables(full, hasher, args) -> None:
    model, cfg = build(full, args.table_rows or full.engram_num_embeddings[0])
    graphdef, state = nnx.split(model)
    s, d, n_rows = cfg.hc_mult, cfg.hidden_size, cfg.engram_num_embeddings[0]

    @jax.jit
    def step(state, streams, rows, text):
        return nnx.merge(graphdef, state)(streams, EngramInput(rows, text))

    print(f"\n## 1. device tables, world 1 ({jax.devices()[0].device_kind}; table {n_rows:,} rows × "
          f"{cfg.engram_head_dim} = {n_rows * (cfg.engram_head_dim + cfg.engram_head_dim // 32) / 1e9:.1f} GB)\n")
    print("| rows | engram ms (device) | step ms | added |")
    print("|---|---|---|---|")
    rng = np.random.default_rng(0)
    for t in (int(x) for x in args.rows.split(",")):
        ids = rng.integers(0, full.vocab_size, (1, t))
        rows, _ = hasher.rows(ids, engram.empty_history(full, 1))
        rows = jnp.asarray(rows[:, :, :1] % n_rows, jnp.int32)  # layer 1's columns, folded into the table
        streams = jax.random.normal(jax.random.key(1), (1, t, s, d), jnp.float32).astype(jnp.bfloat16)
        ms = median_ms(step, state, streams, rows, jnp.ones((1, t), bool), repeats=args.repeats)
        ref = args.prefill_step_ms if t > 1 else args.decode_step_ms
        print(f"| {t:,} | {ms:.3f} | {ref} | {100 * ms / ref:.2f} % (+{ms:.3f} ms) |")
    del model, state
    wkv_held_as_stored(cfg, args)


def wkv_held_as_stored(cfg, args) -> None:
    """The layer's main cost, its ``wkv`` GEMM [T, 6144] × [6144, 25600]: held dequantised (bf16, as the model
    holds dense matrices: 315 MB read a decode step) vs held as stored (e4m3 + one ue8m0 scale per 32×32 block,
    157 MB) and decoded inside the step — whether XLA fuses the decode into the GEMM decides if holding it fp8
    would pay."""
    out_dim, in_dim = (cfg.hc_mult + 1) * cfg.hidden_size, 24 * cfg.engram_head_dim
    key = jax.random.key(3)
    w = (jax.random.normal(key, (out_dim, in_dim), jnp.float32) * in_dim**-0.5).astype(jnp.bfloat16)
    codes = jax.lax.bitcast_convert_type(jax.random.bits(key, (out_dim, in_dim), jnp.uint8) & 0x7E,
                                         jnp.float8_e4m3fn)
    scales = jnp.full((out_dim // 32, in_dim // 32), 120, jnp.uint8)

    @jax.jit
    def held_bf16(x, w):
        return jnp.einsum("ti,oi->to", x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    @jax.jit
    def held_fp8(x, codes, scales):
        step = jax.lax.bitcast_convert_type(scales.astype(jnp.uint32) << 23, jnp.float32).astype(jnp.bfloat16)
        step = jnp.repeat(jnp.repeat(step, 32, axis=0), 32, axis=1)
        return held_bf16(x, codes.astype(jnp.bfloat16) * step)

    print("\n| rows | wkv GEMM, held bf16 (ms) | held e4m3 + block scales, decoded in the step (ms) |")
    print("|---|---|---|")
    for t in (int(x) for x in args.rows.split(",")):
        x = jax.random.normal(key, (t, in_dim), jnp.float32).astype(jnp.bfloat16)
        a = median_ms(held_bf16, x, w, repeats=args.repeats)
        b = median_ms(held_fp8, x, codes, scales, repeats=args.repeats)
        print(f"| {t:,} | {a:.3f} | {b:.3f} |")


def host_hashing(full, hasher, args) -> None:
    print("\n## 2. host hash of a decode step (B = 1; median of 2,000 calls, 0.5 ms simulated device step)\n")
    print("| history terms | hash ms on the step's critical path |")
    print("|---|---|")
    for overlap in (True, False):
        hasher.overlap = overlap
        hist, times = engram.empty_history(full, 1), []
        for i in range(2000):
            ids = np.array([[1000 + 7 * i % 90000]])
            t0 = time.perf_counter()
            _, hist = hasher.rows(ids, hist, lengths=np.ones(1, np.int32))
            times.append(time.perf_counter() - t0)
            time.sleep(0.0005)  # the device step: the engine waits for the sampled token (GIL released)
        print(f"| {'prefetched on the worker thread' if overlap else 'inline'} | {np.median(times) * 1e3:.4f} |")
    hasher.overlap = True


def host_tables(full, hasher, args) -> None:
    n_rows, d = args.host_table_rows, full.engram_head_dim
    width = d + d // 32
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        codes, scales = [], []
        for li in range(len(full.engram_layer_ids)):  # random bytes, written once (then in the page cache)
            path = Path(tmp) / f"table{li}.bin"
            mm = np.memmap(path, np.uint8, "w+", shape=(n_rows, width))
            for lo in range(0, n_rows, 1 << 20):
                hi = min(n_rows, lo + (1 << 20))
                mm[lo:hi] = np.random.default_rng(lo).integers(0, 0x7E, (hi - lo, width), np.uint8)
            mm.flush()
            del mm
            mm = np.memmap(path, np.uint8, "r", shape=(n_rows, width))
            codes.append(mm[:, :d])
            scales.append(np.full((n_rows, d // 32), 120, np.uint8))
        tables = engram.HostTables(codes, scales)
        print(f"\n## 3. host tables: 2 layers × {n_rows:,} rows memory-mapped ({tables.threads} gather threads)\n")
        print("| call | rows gathered | gather ms | rows/s | host→device ms | layer on gathered rows ms |")
        print("|---|---|---|---|---|---|")
        model, cfg = build(full, 1, tables="host")
        graphdef, state = nnx.split(model)
        s, dm = cfg.hc_mult, cfg.hidden_size

        @jax.jit
        def step(state, streams, rows, text, gathered):
            return nnx.merge(graphdef, state)(streams, EngramInput(rows, text, gathered))

        rng = np.random.default_rng(1)
        per_call = {}
        for t in (2048, 1):
            ids = rng.integers(0, full.vocab_size, (1, t))
            rows, _ = hasher.rows(ids, engram.empty_history(full, 1))
            rows = rows % n_rows
            gather_ms = host_ms(lambda: tables.gather(rows), args.repeats)
            buf = tables.gather(rows)
            put_ms = host_ms(lambda: jax.block_until_ready(jax.device_put(buf)), args.repeats)
            streams = jax.random.normal(jax.random.key(1), (1, t, s, dm), jnp.float32).astype(jnp.bfloat16)
            dev_rows, text, dev_buf = jnp.asarray(rows, jnp.int32), jnp.ones((1, t), bool), jax.device_put(buf)
            layer_ms = median_ms(step, state, streams, dev_rows, text, dev_buf, repeats=args.repeats)
            n = rows.size
            print(f"| {'prefill' if t > 1 else 'decode'} {t:,} row{'s' if t > 1 else ''} | {n:,} | {gather_ms:.3f} | "
                  f"{n / gather_ms * 1e3:,.0f} | {put_ms:.3f} | {layer_ms:.3f} |")
            per_call[t] = (gather_ms, put_ms, layer_ms, rows, streams, text)
        pipeline(tables, step, state, per_call[2048], args)
        hash_ms = host_ms(lambda: hasher.rows(np.array([[5]]), engram.empty_history(full, 1)), 200)
        g, p, layer, *_ = per_call[1]
        print(f"\ndecode step with host tables (not overlapped: its rows need the token just sampled): hash "
              f"{hash_ms:.3f} + gather {g:.3f} + copy {p:.3f} ms = +{hash_ms + g + p:.3f} ms of host latency a step, "
              f"plus the layer's {layer:.3f} ms on the device")


def pipeline(tables, step, state, call, args) -> None:
    """A prompt of ``args.segments`` 2,048-row segments: serial vs overlapped gathers (ms per segment)."""
    _, _, _, rows, streams, text = call
    segs = [(rows + k * 7919) % tables.codes[0].shape[0] for k in range(args.segments)]

    def serial():
        for r in segs:
            out = step(state, streams, jnp.asarray(r, jnp.int32), text, jax.device_put(tables.gather(r)))
            jax.block_until_ready(out)

    def overlapped():
        out, nxt = None, tables.gather(segs[0])
        for k, r in enumerate(segs):
            out = step(state, streams, jnp.asarray(r, jnp.int32), text, jax.device_put(nxt))  # async dispatch
            if k + 1 < len(segs):
                nxt = tables.gather(segs[k + 1])  # on the host while the device runs segment k
        jax.block_until_ready(out)

    serial(), overlapped()  # warm
    ser = host_ms(serial, 3) / len(segs)
    ovl = host_ms(overlapped, 3) / len(segs)
    print(f"\nprefill of {len(segs)} × 2,048 rows with host tables: serial {ser:.3f} ms a segment, overlapped "
          f"{ovl:.3f} ms a segment (gathers {'hidden' if ovl < 0.9 * ser else 'NOT hidden'} behind the device)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table-rows", type=int, default=None, help="device table rows (default: the release's layer 1)")
    p.add_argument("--host-table-rows", type=int, default=8_000_000, help="host table rows a layer (default 8M)")
    p.add_argument("--rows", default="2048,1", help="token rows per call (default 2048,1)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--segments", type=int, default=8, help="segments of the host-tables prefill (default 8)")
    p.add_argument("--prefill-step-ms", type=float, default=28.65)
    p.add_argument("--decode-step-ms", type=float, default=2.58)
    p.add_argument("--tmp", default=None, help="directory of the temporary host tables (default: the system's)")
    p.add_argument("--skip", default="", help="comma list of parts to skip: device,hash,host")
    args = p.parse_args()
    full = load_named("dsv41_flash")
    hasher = engram.Hasher(full)  # hashes of the release layout; rows folded into smaller tables
    skip = set(args.skip.split(","))
    if "device" not in skip:
        device_tables(full, hasher, args)
    if "hash" not in skip:
        host_hashing(full, hasher, args)
    if "host" not in skip:
        host_tables(full, hasher, args)


if __name__ == "__main__":
    main()
