"""The comb's softmax + Sinkhorn (MODEL.md §B.3) as one Pallas kernel.

XLA runs Sinkhorn as a loop of small reduce and divide kernels, a few launches per iteration and mix, most of a
decode step's launches (measured: see docs/BENCHMARKS.md, section "Decode: one program a step"). Here one
program holds a tile of rows with the S·S entries of each row's matrix as S·S separate row vectors (the input is
laid out [S·S, N]), so every pass is elementwise arithmetic on registers: one launch per mix, whatever the
number of iterations (a loop inside the kernel). Summation order inside a row or column is left to right (the
XLA reduce may pair differently: a few ulp).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _comb_kernel(x_ref, o_ref, *, s: int, iters: int, eps: float):
    c = [x_ref[k, :] for k in range(s * s)]  # c[i*s + j]: source i -> destination j, each [R]

    def rows(c):
        out = []
        for i in range(s):
            row = c[i * s:(i + 1) * s]
            total = row[0]
            for v in row[1:]:
                total = total + v
            out += [v / (total + eps) for v in row]
        return out

    def columns(c):
        totals = []
        for j in range(s):
            total = c[j]
            for i in range(1, s):
                total = total + c[i * s + j]
            totals.append(total + eps)
        return [c[k] / totals[k % s] for k in range(s * s)]

    soft = []
    for i in range(s):  # softmax over j, then + eps
        row = c[i * s:(i + 1) * s]
        m = row[0]
        for v in row[1:]:
            m = jnp.maximum(m, v)
        e = [jnp.exp(v - m) for v in row]
        total = e[0]
        for v in e[1:]:
            total = total + v
        soft += [v / total + eps for v in e]
    c = columns(soft)
    # A loop inside the kernel (no launches): the unrolled 39 passes made the program ~20x larger to compile.
    c = jax.lax.fori_loop(0, iters - 1, lambda _, c: tuple(columns(rows(list(c)))), tuple(c))
    for k in range(s * s):
        o_ref[k, :] = c[k]


@functools.partial(jax.jit, static_argnames=("iters", "eps", "block_rows", "interpret"))
def comb_pallas(logits: jnp.ndarray, iters: int, eps: float, *, block_rows: int = 256,
                interpret: bool = False) -> jnp.ndarray:
    """logits f32 [..., S, S] -> Sinkhorn(softmax over the last axis + eps), same layout."""
    *lead, s, s2 = logits.shape
    assert s == s2, logits.shape
    n = 1
    for d in lead:
        n *= d
    # Mosaic GPU (pallas_call's default GPU backend) takes vectors of whole warpgroups: 128 rows at least
    rows = max(128, min(block_rows, pl.next_power_of_2(max(n, 1))))
    padded = -(-n // rows) * rows
    x = logits.reshape(n, s * s).astype(jnp.float32).T  # [S·S, N]
    x = jnp.pad(x, ((0, 0), (0, padded - n)))
    out = pl.pallas_call(
        functools.partial(_comb_kernel, s=s, iters=iters, eps=eps),
        out_shape=jax.ShapeDtypeStruct((s * s, padded), jnp.float32),
        grid=(padded // rows,),
        in_specs=[pl.BlockSpec((s * s, rows), lambda r: (0, r))],
        out_specs=pl.BlockSpec((s * s, rows), lambda r: (0, r)),
        interpret=interpret,
    )(x)
    return out[:, :n].T.reshape(*lead, s, s)
