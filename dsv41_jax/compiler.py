"""The XLA options every program of the engine (and `profile`, `benchmarks/`) is compiled with.

On a GPU, XLA's Triton GEMM fusions are off: XLA then autotunes only among cuBLAS's algorithms instead of
compiling and timing dozens of Triton tilings per GEMM shape. Measured on the H200 (jax 0.11.2, 2026-12-01,
docs/BENCHMARKS.md "Compile time"): the 2-layer full-width 2,048-row prefill compiles in 6.9 s instead of 36 s
and runs in 23.8 ms vs 23.4 ms; the decode step is unchanged. ``--xla_gpu_autotune_level=0`` compiles as fast
but its untuned Triton GEMMs made that prefill 3.8× slower. XLA_FLAGS set by the user still apply to anything
not named here.
"""

from __future__ import annotations

import jax

GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def options(platform: str | None = None) -> dict:
    """The compile options for ``platform`` (default: the default backend's), for ``Lowered.compile``."""
    platform = platform or jax.default_backend()
    return dict(GPU_OPTIONS) if platform in ("gpu", "cuda", "rocm") else {}
