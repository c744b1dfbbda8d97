"""Block-scaled fp8 matmul (dense weights as stored: e4m3 codes + ue8m0 32×32 block scales, MODEL.md §E.1): ops
(public entry), xla and Pallas implementations, the float64 oracle for the tests (``reference.py``)."""

from pallas_kernels.fp8_matmul.ops import Fp8Weight, fp8_matmul

__all__ = ["Fp8Weight", "fp8_matmul"]
