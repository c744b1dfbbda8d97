"""The indexer's maxima pass as a warp-specialised Pallas Mosaic GPU kernel (Hopper, sm_90a).

Same function as ``kernel._maxima_kernel`` with groups of 8 keys and bf16 operands (a reindex layer's candidate
mask, one block per group, is applied to the maxima after: ``kernel._maxima``):
maxima[t, g] = max over the keys j of group g of Σ_h w'[h, t]·ReLU(q[h, t]·keys[j]) (bf16 MMA, f32 accumulation,
f32 head sum; w' = w·d^(−1/2), ``kernel._score_operands``), −∞ where j ≥ nvis[t]. ``kernel`` calls it for the
prefill launches it fits (``supported``); the Triton pass runs everything else (and every CPU interpret run).

Why. In the Triton pass, per key tile, the per-head chain (load q_h, MMA, wait, ReLU-FMA) is serial in the
Triton lowering, whatever the source order, which holds it below the GEMM rate. Here one
CTA is three warpgroups, as jax's FlashAttention-3 example (``ops/gpu/attention_mgpu.py``): a memory warpgroup
streams q_h tiles ([64, 128] bf16, ``q_slots`` buffers; q for all heads of 64 rows is 512 KB, so it cannot stay)
and key half-tiles (``key_slots`` buffers) by TMA with barriers, and two compute warpgroups score the same 64
rows against their own ``kpw`` keys of a step: per head S = wgmma(q_h, kᵀ), acc += max(S, 0)·w'_h. The two
warpgroups' MMAs and epilogues overlap on the SM (faster than the Triton pass; the FA3-style schedule barrier
between them made it slower, so it is off by default; measured: see docs/BENCHMARKS.md, section "Indexer score
pass on Mosaic GPU").

Group maxima without a reshape (a WGMMA-layout array cannot split its minor dimension): the keys are permuted
in HBM first (an 8×8 transpose inside each block of 64 keys: position 8i + g holds key 8g + i), so the 8 keys of
group g of a 64-key block sit in the 8 column slices [:, 8i : 8i + 8] at the same column; the elementwise
maximum of those slices is the block's 8 group maxima, in order. Steps no row of a program can see are neither
loaded nor scored (their groups are −∞).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.indexer.tiling import key_splits

GROUP = 8          # keys per maximum
BM = 64            # query rows per program (one wgmma M tile)
HEAD_DIM = 128     # the index head dim the shared-memory tiling is laid out for (128-byte swizzle)
SMEM_LIMIT = 227 * 1024
COMPUTE_REGS, MEM_REGS = 232, 40  # registers a thread of the compute / memory warpgroups (setmaxnreg), as FA3


def supported(*, group: int, head_dim: int, heads: int, masked: bool, score_dtype: str, interpret: bool) -> bool:
    """Whether a maxima launch runs here: compiled on an sm_90 GPU, bf16 operands, groups of 8, no mask inside a
    group, the 128-wide index heads of the release, at most 64 heads."""
    if interpret or masked or score_dtype != "bfloat16" or group != GROUP:
        return False
    if head_dim != HEAD_DIM or heads > 64 or jax.default_backend() != "gpu":
        return False
    return getattr(jax.devices()[0], "compute_capability", None) == "9.0" and lowers_here()


@functools.cache
def lowers_here() -> bool:
    """Whether this jax lowers the kernel for CUDA (a small instance, once a process): under a jax whose Mosaic GPU
    API has moved on, the op falls back to the Triton pass with a warning instead of failing the whole program."""
    s = jax.ShapeDtypeStruct
    args = (s((2, BM, HEAD_DIM), jnp.bfloat16), s((2, BM), jnp.float32), s((1024, HEAD_DIM), jnp.bfloat16),
            s((BM,), jnp.int32))
    try:
        jax.jit(maxima).trace(*args).lower(lowering_platforms=("cuda",))
    except Exception as e:  # noqa: BLE001 - any lowering failure means: not this kernel, here
        warnings.warn(f"the indexer's Mosaic GPU score pass does not lower with jax {jax.__version__} "
                      f"({type(e).__name__}: {str(e)[:200]}); the Triton pass runs instead", stacklevel=2)
        return False
    return True


def permute_keys(keys):
    """The kernel's key order: inside each block of 64 keys, position 8i + g holds key 8g + i (self-inverse).
    keys [N, d] with N % 64 == 0."""
    n, d = keys.shape
    return keys.reshape(n // 64, 8, 8, d).swapaxes(1, 2).reshape(n, d)


def smem_bytes(*, kpw: int, key_slots: int, q_slots: int, heads: int, d: int = HEAD_DIM) -> int:
    """Shared memory of one CTA: q and key buffers, w and nvis of its rows, the output staging, barriers."""
    return (q_slots * BM * d * 2 + key_slots * 2 * kpw * d * 2 + heads * BM * 4 + BM * 4
            + 2 * (kpw // 64) * BM * 8 * 4 + 1024)


def _kernel(*, heads, d, kpw, steps, key_slots, q_slots, sched, interpret):
    """The CTA's body: warpgroups 0 and 1 compute, 2 copies (module docstring)."""
    ks = 2 * kpw               # keys per step
    chunks = kpw // 64         # 64-key blocks per warpgroup half-step (each -> [64, 8] group maxima)
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def lay(x, layout):        # layout hints (the GPU interpreter has no rule for layout_cast)
        return x if interpret else plgpu.layout_cast(x, layout)

    def load_row(ref):         # [64] SMEM vector -> WGMMA row layout
        if interpret:          # the interpreter has no rule for plgpu.load (load_p)
            return ref[...]
        return plgpu.load(ref, (), layout=row_layout)

    def body(live_ref, nvis_ref, q_ref, w_ref, k_ref, out_ref,
             q_smem, k_smem, w_smem, nv_smem, o_smem, q_bar, k_bar, w_bar, nv_bar, q_free, k_free, sched_bar):
        rb = lax.axis_index("rb")
        sp = lax.axis_index("sp")
        wg = lax.axis_index("wg")
        row0 = rb * BM
        split_key0 = sp * (steps * ks)
        live = live_ref[rb, sp]

        def schedule():
            if sched:
                plgpu.barrier_arrive(sched_bar)
                plgpu.barrier_wait(sched_bar)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGS, action="increase")
            plgpu.barrier_wait(w_bar)
            plgpu.barrier_wait(nv_bar)
            nv = load_row(nv_smem)                                        # [64] int32
            # [64, 8] slice i of 64-key block c holds, in column j, key 64*c + 8*j + i of the half-step
            j8 = lay(lax.broadcasted_iota(jnp.int32, (BM, 8), 1), wgmma_layout) * 8

            def store_out(step, parts):
                """parts: chunks x [64, 8] f32 -> out[rows, groups of (step, wg)]."""
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the staging buffer's last copy has read it
                for c in range(chunks):
                    o_smem[wg, c] = parts[c]
                plgpu.commit_smem()
                g0 = (split_key0 + step * ks + wg * kpw) // GROUP
                for c in range(chunks):
                    plgpu.copy_smem_to_gmem(o_smem.at[wg, c],
                                            out_ref.at[pl.ds(row0, BM), pl.ds(g0 + c * 8, 8)])

            pl.when(wg == 1)(schedule)

            def live_step(step, carry):
                kslot = step % key_slots
                plgpu.barrier_wait(k_bar.at[kslot * 2 + wg])
                k_t = plgpu.transpose_ref(k_smem.at[kslot, wg], (1, 0))     # [d, kpw]

                def head(h, acc):
                    qslot = (step * heads + h) % q_slots
                    plgpu.barrier_wait(q_bar.at[qslot])

                    def mma(acc_ref):
                        plgpu.wgmma(acc_ref, q_smem.at[qslot], k_t)
                        schedule()
                        return acc_ref[...]

                    s = pl.run_scoped(mma, plgpu.ACC((BM, kpw), jnp.float32))
                    plgpu.barrier_arrive(q_free.at[qslot])
                    wh = load_row(w_smem.at[h])
                    return acc + jnp.maximum(s, 0.0) * lax.broadcast_in_dim(wh, (BM, kpw), (0,))

                acc0 = lay(jnp.zeros((BM, kpw), jnp.float32), wgmma_layout)
                acc = lax.fori_loop(0, heads, head, acc0)
                plgpu.barrier_arrive(k_free.at[kslot])
                lim = nv - (split_key0 + step * ks + wg * kpw)               # visible keys of this half-step
                parts = []
                for c in range(chunks):
                    m = None
                    for i in range(8):
                        ok = j8 < lax.broadcast_in_dim(lim - (64 * c + i), (BM, 8), (0,))
                        x = jnp.where(ok, acc[:, 64 * c + 8 * i: 64 * c + 8 * i + 8], -jnp.inf)
                        m = x if m is None else jnp.maximum(m, x)
                    parts.append(m)
                store_out(step, parts)
                return carry

            lax.fori_loop(0, live, live_step, None)
            pl.when(wg == 0)(schedule)

            def dead_step(step, carry):
                ninf = lay(jnp.full((BM, 8), -jnp.inf, jnp.float32), wgmma_layout)
                store_out(step, [ninf] * chunks)
                return carry

            lax.fori_loop(live, steps, dead_step, None)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(MEM_REGS, action="decrease")
            plgpu.copy_gmem_to_smem(w_ref.at[:, pl.ds(row0, BM)], w_smem, w_bar)
            plgpu.copy_gmem_to_smem(nvis_ref.at[pl.ds(row0, BM)], nv_smem, nv_bar)

            def load_keys(step):
                slot = step % key_slots
                key0 = split_key0 + step * ks
                for half in range(2):
                    plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(key0 + half * kpw, kpw)], k_smem.at[slot, half],
                                            k_bar.at[slot * 2 + half])

            for j in range(key_slots - 1):                       # prologue: the first key_slots - 1 steps
                @pl.when(j < live)
                def _():
                    load_keys(j)

            h_keys = min(q_slots, heads - 1)   # issue step+key_slots-1's keys after this head's q (no stall)

            def step_loop(step, carry):
                def head(h, carry):
                    c = step * heads + h
                    qslot = c % q_slots

                    @pl.when(c >= q_slots)
                    def _():
                        plgpu.barrier_wait(q_free.at[qslot])

                    plgpu.copy_gmem_to_smem(q_ref.at[h, pl.ds(row0, BM)], q_smem.at[qslot], q_bar.at[qslot])

                    @pl.when((h == h_keys) & (step + key_slots - 1 < live))
                    def _():
                        nxt = step + key_slots - 1

                        @pl.when(nxt >= key_slots)
                        def _():
                            plgpu.barrier_wait(k_free.at[nxt % key_slots])

                        load_keys(nxt)
                    return carry

                return lax.fori_loop(0, heads, head, carry)

            lax.fori_loop(0, live, step_loop, None)

            # Drain: observe the last completions of the free barriers (the interpreter requires every phase
            # of a barrier to be observed by the threads waiting on it; on the GPU this only delays the exit).
            loads = live * heads

            def drain_q(c, carry):
                plgpu.barrier_wait(q_free.at[c % q_slots])
                return carry

            lax.fori_loop(jnp.maximum(loads - q_slots, 0), loads, drain_q, None)

            def drain_k(step, carry):
                plgpu.barrier_wait(k_free.at[step % key_slots])
                return carry

            lax.fori_loop(jnp.maximum(live - key_slots, 0), live, drain_k, None)

    return body


def _plan(t: int, n: int, *, kpw: int, splits: int | None):
    """(row blocks, key splits, steps a split, padded keys): steps of 2·kpw keys, splits as the Triton pass's."""
    ks = 2 * kpw
    rb = -(-t // BM)
    tiles = max(1, -(-n // ks))
    s = min(splits or key_splits(rb, tiles), tiles)
    steps = -(-tiles // s)
    return rb, s, steps, s * steps * ks


def maxima(q, w, keys, nvis, *, kpw: int = 128, key_slots: int = 2, q_slots: int = 4, splits: int | None = None,
           sched: bool = False, interpret=False):
    """One sequence's group maxima: q bf16 [H, T, d], w f32 [H, T] (w'), keys bf16 [N, d], nvis int32 [T] ->
    f32 [T, ⌈N/8⌉]. Tiling: ``kpw`` keys per compute warpgroup a step (a multiple of 64), ``key_slots`` /
    ``q_slots`` buffers, ``splits`` key splits per 64-row block (default: ``tiling.key_splits``), ``sched`` the
    FA3 schedule barrier. ``interpret``: a ``jax._src.pallas.mosaic_gpu.interpret`` params object (tests)."""
    heads, t, d = q.shape
    n = keys.shape[0]
    if kpw % 64 or not 64 <= kpw <= 256 or key_slots < 2 or q_slots < 2:
        raise ValueError(f"mosaic maxima tiling: kpw {kpw} (64..256, a multiple of 64), key_slots {key_slots} and "
                         f"q_slots {q_slots} (>= 2)")
    smem = smem_bytes(kpw=kpw, key_slots=key_slots, q_slots=q_slots, heads=heads, d=d)
    if smem > SMEM_LIMIT:
        raise ValueError(f"mosaic maxima tiling needs {smem} bytes of shared memory (> {SMEM_LIMIT})")
    rb, s, steps, n_pad = _plan(t, n, kpw=kpw, splits=splits)
    t_pad = rb * BM
    groups = -(-n // GROUP)
    # N/8 rounded up to 4 (TMA rows are 16-byte multiples); the last step's stores past it are clipped by the TMA
    out_cols = -(-groups // 4) * 4 if not interpret else n_pad // GROUP  # the interpreter drops, not clips
    q = jnp.pad(q.astype(jnp.bfloat16), ((0, 0), (0, t_pad - t), (0, 0)))
    w = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, t_pad - t)))
    nvis = jnp.pad(jnp.clip(nvis.astype(jnp.int32), 0, n), (0, t_pad - t))           # padding rows see nothing
    kp = permute_keys(jnp.pad(keys.astype(jnp.bfloat16), ((0, n_pad - n), (0, 0))))
    ks = 2 * kpw
    block_max = jnp.max(nvis.reshape(rb, BM), axis=1)
    first = jnp.arange(s, dtype=jnp.int32) * (steps * ks)
    live = jnp.clip(-(-(block_max[:, None] - first[None, :]) // ks), 0, steps).astype(jnp.int32)  # [rb, s]

    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = [
        plgpu.SMEM((q_slots, BM, d), jnp.bfloat16, transforms=tiled),
        plgpu.SMEM((key_slots, 2, kpw, d), jnp.bfloat16, transforms=tiled),
        plgpu.SMEM((heads, BM), jnp.float32),
        plgpu.SMEM((BM,), jnp.int32),
        plgpu.SMEM((2, kpw // 64, BM, 8), jnp.float32),
    ]
    barriers = [
        plgpu.Barrier(num_barriers=q_slots),                    # q_h loaded
        plgpu.Barrier(num_barriers=2 * key_slots),              # key half-tile loaded
        plgpu.Barrier(),                                        # w loaded
        plgpu.Barrier(),                                        # nvis loaded
        plgpu.Barrier(num_arrivals=2, num_barriers=q_slots),    # q slot free (both compute warpgroups done)
        plgpu.Barrier(num_arrivals=2, num_barriers=key_slots),  # key slot free
        plgpu.Barrier(num_arrivals=2),                          # schedule barrier (sched only)
    ]
    body = _kernel(heads=heads, d=d, kpw=kpw, steps=steps, key_slots=key_slots, q_slots=q_slots, sched=sched,
                   interpret=bool(interpret))

    def entry(live_ref, nvis_ref, q_ref, w_ref, k_ref, out_ref):
        pl.run_scoped(functools.partial(body, live_ref, nvis_ref, q_ref, w_ref, k_ref, out_ref),
                      *scratch, *barriers, collective_axes="wg")

    kw = dict(grid=(rb, s), grid_names=("rb", "sp"), num_threads=3, thread_name="wg")
    if interpret:
        kw["interpret"] = interpret
    call = plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((t_pad, out_cols), jnp.float32), **kw)
    out = call(live, nvis, q, w, kp)
    return out[:t, :groups] if (t_pad, out_cols) != (t, groups) else out
