"""The block-scaled fp8 matmul's test oracle: float64 numpy, W dequantised by MODEL.md §E.1's formula (ml_dtypes'
e4m3 values times the codec's scale values; equal to ``dsv41_jax.formats.fp8_dequantize``, tested, and faster on
the release's 42 M-element matrices), then one float64 matmul. Tests and benchmarks compare every implementation
of ``ops.fp8_matmul`` with it; the model never calls it.

``error_bound`` is the tolerance the tests hold every implementation to, derived rather than tuned. An
implementation forms the products x·w — exactly (bf16 × bf16, or the Pallas kernel's bf16 pieces of an f32 x) or
rounded once (f32 × f32) — and adds them in f32 in some order, so each output element is within
γ_n · Σ_k |x_k||w_k| of the exact sum, γ_n = n·u / (1 − n·u), n the roundings on the longest path: at most K
additions and one product rounding, or 3K additions where an f32 x is split into three bf16 pieces; the bound
takes n = 3K + 1 for every implementation. u = 2^-23, twice f32's unit roundoff: the bound then also holds for an
accumulator that truncates rather than rounds (tensor-core accumulation is not documented to round to nearest).
A result rounded to bf16 adds that rounding, at most 2^-8 of its magnitude.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from dsv41_jax.formats import BLOCK, scale_values

E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
ACCUMULATOR_UNIT = 2.0**-23  # f32 with truncation allowed (module docstring)
BF16_UNIT = 2.0**-8


def dequantize(codes, scales) -> np.ndarray:
    """W [N, K] float64 from e4m3 codes (or their raw bytes) and ue8m0 scales [⌈N/32⌉, ⌈K/32⌉]:
    W[o, i] = e4m3(codes[o, i]) · 2^(scales[o//32, i//32] − 127)."""
    values = E4M3_VALUES[np.asarray(codes).view(np.uint8)]
    n, k = values.shape
    steps = scale_values(scales)
    padded = np.pad(values, ((0, -n % BLOCK), (0, -k % BLOCK)))
    blocks = padded.reshape(steps.shape[0], BLOCK, steps.shape[1], BLOCK) * steps[:, None, :, None]
    return blocks.reshape(padded.shape)[:n, :k]


def grouped_matmul(x: np.ndarray, w: np.ndarray, groups: int = 1) -> np.ndarray:
    """x [M, G·K] · Wᵀ per group (W [N, K]: G row blocks of N/G rows, block g against x's columns g·K..(g+1)·K),
    float64 [M, N]."""
    n, k = w.shape
    xg = np.asarray(x, np.float64).reshape(x.shape[0], groups, k)
    return np.einsum("mgi,goi->mgo", xg, w.reshape(groups, n // groups, k)).reshape(x.shape[0], n)


def fp8_matmul_reference(x, codes, scales, *, groups: int = 1) -> np.ndarray:
    """y [M, N] float64 = x [M, G·K] · dequant(codes, scales)ᵀ per group."""
    return grouped_matmul(np.asarray(x, np.float64), dequantize(codes, scales), groups)


def error_bound(x, w: np.ndarray, *, groups: int = 1, bf16_out: bool = False) -> np.ndarray:
    """[M, N] float64: the largest |y − y_exact| an implementation may show (module docstring); ``w`` the
    dequantised W (``dequantize``)."""
    x = np.asarray(x, np.float64)
    n_roundings = 3 * w.shape[1] + 1
    gamma = n_roundings * ACCUMULATOR_UNIT / (1 - n_roundings * ACCUMULATOR_UNIT)
    bound = gamma * grouped_matmul(np.abs(x), np.abs(w), groups)
    if bf16_out:
        bound = bound + BF16_UNIT * (np.abs(grouped_matmul(x, w, groups)) + bound)
    return bound
