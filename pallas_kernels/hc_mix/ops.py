"""Public entry: ``comb`` (the HC mix's comb matrix: softmax + Sinkhorn, MODEL.md §B.3), one signature over the
registry's implementations ("xla" | "pallas", ``pallas_kernels.registry``)."""

from __future__ import annotations

import jax

from pallas_kernels import registry
from pallas_kernels.hc_mix.kernel import comb_pallas
from pallas_kernels.hc_mix.xla import comb_xla

IMPLS = registry.IMPLEMENTATIONS


def comb(logits, *, iters: int, eps: float, impl: str = "xla", interpret: bool | None = None):
    """logits f32 [..., S, S] (the mix's comb part, C[i, j] = m[2S + S·i + j]) -> the doubly stochastic comb:
    softmax over j, + eps, then Sinkhorn with ``iters`` iterations (columns first and last, 2·iters − 1 passes).
    impl: "xla" | "pallas" ("reference": the deprecated name of "xla"); interpret: None = True unless running on a
    GPU (pallas only)."""
    impl = registry.resolve(impl)
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if impl == "xla":
        return comb_xla(logits, iters, eps)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return comb_pallas(logits, iters, eps, interpret=interpret)
