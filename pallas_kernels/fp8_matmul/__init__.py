"""Block-scaled fp8 matmul (dense weights as stored: e4m3 codes + ue8m0 32×32 block scales, MODEL.md §E.1): ops
(public entry), xla and Pallas implementations, the kernel's tiling (pure Python), the float64 oracle for the tests
(``reference.py``).

``Fp8Weight`` and ``fp8_matmul`` are imported lazily so that ``pallas_kernels.fp8_matmul.tiling`` serves the
planner without importing JAX."""

__all__ = ["Fp8Weight", "fp8_matmul"]


def __getattr__(name: str):
    if name in __all__:
        from pallas_kernels.fp8_matmul import ops  # noqa: PLC0415 - JAX only when the op is asked for
        return getattr(ops, name)
    raise AttributeError(f"module 'pallas_kernels.fp8_matmul' has no attribute {name!r}")
