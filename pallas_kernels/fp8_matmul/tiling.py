"""The block-scaled fp8 matmul kernel's launch configuration (pure Python: the planner sizes the kernel's
workspace from it without importing JAX): ``KernelConfig``, ``default_config`` and the bytes of a call's K-split
partial sums."""

from __future__ import annotations

from dataclasses import dataclass

SCALE_BLOCK = 32  # one ue8m0 scale per 32×32 block of W (MODEL.md §E.1)
DECODES = ("cvt", "alu")


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes and launch settings. block_m: activation rows a program (the MMA's narrow side, ≥ 16);
    block_n: weight rows a program (≥ 16, divides the rows of a group); block_k: K columns a step (a multiple of
    32: whole scale blocks); k_splits: programs along K (each stores an f32 partial sum; 1: the kernel stores y)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3
    decode: str = "cvt"


DECODE_ROWS = 64  # up to this many rows a call is decode-sized (``default_config``)
SM_COUNT = 132  # H200 multiprocessors: decode-sized calls split K until about one wave of programs runs


def _largest_block(size: int, candidates: tuple[int, ...]) -> int:
    return next(b for b in candidates if size % b == 0)


def _k_splits(steps: int, programs: int) -> int:
    """The fewest K splits (a divisor of the K steps) that give about one wave of programs."""
    for splits in range(1, steps + 1):
        if steps % splits == 0 and programs * splits >= SM_COUNT:
            return splits
    return steps


def default_config(rows: int, n: int, k: int, groups: int = 1) -> KernelConfig:
    """Blocks for ``rows`` activation rows against W [N, K] (``groups`` row blocks; the Pallas path's shape rules
    hold: ``check_kernel_shapes``).

    Decode-sized (≤ 64 rows): 16 / 32 / 64 rows a program, 64 weight rows, 256-wide K chunks where they divide
    (the most bytes a program has in flight a step), 3 stages, and K split until the programs make one wave of the
    H200's 132 multiprocessors (unsplit, a 576-row shared-expert projection is 9 programs reading 320 KB each in
    sequence). Prefill-sized: 128 × 128 tiles (8 warps) from 64-wide K chunks, no split. At one row the
    fastest of six variants timed on the H200; at 2,048 rows none was faster on all three shapes timed
    (BENCHMARKS.md "The block-scaled fp8 matmul op, one rank of world 4")."""
    rows_per_group = n // groups
    if rows <= DECODE_ROWS:
        block_m = next(b for b in (16, 32, 64) if rows <= b)
        block_n = _largest_block(rows_per_group, (64, 32, 16))
        block_k = _largest_block(k, (256, 128, 64, 32))
        splits = _k_splits(k // block_k, n // block_n)
        return KernelConfig(block_m=block_m, block_n=block_n, block_k=block_k, k_splits=splits,
                            num_warps=4, num_stages=3)
    block_n = _largest_block(rows_per_group, (128, 64, 32, 16))
    block_k = _largest_block(k, (64, 32))
    return KernelConfig(block_m=128, block_n=block_n, block_k=block_k, num_warps=8 if block_n == 128 else 4,
                        num_stages=3)


def partial_sums_bytes(rows: int, n: int, k: int, groups: int = 1) -> int:
    """Bytes of the f32 partial sums [S, Mp, N] a call of ``rows`` rows against W [N, K] stores when
    ``default_config`` splits K (S > 1; 0 otherwise, and for a shape the kernel does not take, which the XLA
    implementation runs): the op's workspace beyond x and y."""
    if n % groups or (n // groups) % 16 or k % SCALE_BLOCK:
        return 0
    cfg = default_config(rows, n, k, groups)
    if cfg.k_splits == 1:
        return 0
    return cfg.k_splits * -(-rows // cfg.block_m) * cfg.block_m * n * 4
