"""Where the Pallas Triton lowering cannot address an expert operand in place, and what the MoE op copies there.

Pure Python: the planner sizes the copy (workspace role ``L.moe.unwrapped``) without importing JAX; ``ops``
applies the same rule to its operands.

The lowering addresses an operand with 32-bit signed element offsets unless it is larger than 2**32 bytes
(jax 0.10.2 / 0.11.2, ``_compute_offsets_from_indices``), so an operand of one-byte elements (fp4 codes) between
2**31 and 2**32 bytes wraps its offsets and reads outside itself (CUDA_ERROR_ILLEGAL_ADDRESS on the H200,
docs/BENCHMARKS.md). bf16 and scale operands cannot hit it (2-byte elements switch to 64-bit first; the scales
are 16x smaller than their codes). A scanned unit's stack of fp4 experts there is not read in place: each call
copies what it reads (``ops._unwrapped``; docs/DESIGN.md "Scanned layers" item 7).
"""

from __future__ import annotations

INT32_WRAP_BYTES = (2**31, 2**32)


def wraps(itemsize: int, size: int) -> bool:
    """True for an operand of ``size`` elements of ``itemsize`` bytes whose offsets the lowering would wrap."""
    lo, hi = INT32_WRAP_BYTES
    return itemsize == 1 and lo <= size <= hi


def copied_experts(layers: int, experts: int, matrix_codes: int, pairs: int) -> int:
    """Experts a call of ``pairs`` (token, expert) pairs copies from a stack of ``layers`` layers of ``experts`` fp4
    experts whose code matrices (w1, w3, w2) hold ``matrix_codes`` bytes each an expert: 0 when the stack is read
    in place (a single layer is never a stack); else the pairs' experts (decode: fewer pairs than experts) or the
    layer's."""
    if layers < 2 or not wraps(1, layers * experts * matrix_codes):
        return 0
    return min(pairs, experts)
