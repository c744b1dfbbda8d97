"""The indexer kernel's static tiling and HBM workspace (pure Python: the planner imports it without JAX)."""

from __future__ import annotations

TARGET_PROGRAMS = 264  # H200: 132 SMs; split the keys until about two waves of programs run


def tiling(batch: int, rows: int, keys: int, k: int, *, keep_blocks: int = 0, block_size: int = 1,
           block_rows=None, key_tile=None, group=None, splits=None, num_warps=None, num_stages=None) -> dict:
    """The kernel's tiling for one launch of ``batch`` × ``rows`` query rows against ``keys`` keys.

    block_rows: query rows per program (16 for ≤ 16 rows, else 64; ≥ 16 for the MMA); key_tile: 64 keys;
    group: keys per maximum (B_c for the candidate source, else 8); splits: key splits per row block so that
    about TARGET_PROGRAMS programs run (few for a 2,048-row prefill; many for decode); num_stages: 4 (the
    key tiles' copy pipeline). Defaults: the H200 sweep of docs/BENCHMARKS.md (issue 15). capacity: candidate
    slots per row, min(2·G·(K−1) + K, padded keys) (never overflows, kernel.py)."""
    br = block_rows or (16 if rows <= 16 else 64)
    kt = key_tile or 64
    g = block_size if keep_blocks else (group or 8)
    if kt % g or g & (g - 1) or kt & (kt - 1) or br & (br - 1) or br < 16 or kt < 16:
        raise ValueError(f"indexer kernel tiling: block_rows {br} and key_tile {kt} must be powers of two ≥ 16 "
                         f"and the group {g} a power of two dividing key_tile")
    tiles = max(1, -(-keys // kt))
    blocks = batch * -(-rows // br)
    s = min(splits or max(1, min(tiles, -(-TARGET_PROGRAMS // blocks))), tiles)
    kk = max(1, min(k, keys))
    return {"block_rows": br, "key_tile": kt, "group": g, "splits": s,
            "num_warps": num_warps or 4, "num_stages": num_stages or 4,
            "capacity": min(2 * g * (kk - 1) + kk, s * -(-tiles // s) * kt)}


def workspace_bytes(batch: int, rows: int, keys: int, k: int, *, heads: int, head_dim: int, keep_blocks: int = 0,
                    block_size: int = 1, masked: bool = False, score_bytes: int = 2) -> dict[str, int]:
    """HBM scratch of one launch of ``rows`` query rows (role -> bytes), an upper bound of what the op
    allocates beside its inputs and output: the group maxima (with the pass loop's and lax.top_k's copies;
    the candidate source's level-1 mask works on the same maxima), the candidate buffers, their written mask
    and the final top-k's input, the MMA operands of the rows (q, w) and of the keys (``keys``: per call, not per launch),
    the candidate mask as int8, per-split counters, and for the candidate source lax.top_k's K_B block picks
    and the kept mask."""
    tl = tiling(batch, rows, keys, k, keep_blocks=keep_blocks, block_size=block_size)
    br, kt, g, s = tl["block_rows"], tl["key_tile"], tl["group"], tl["splits"]
    t_pad = -(-rows // br) * br
    n_pad = s * -(-max(1, -(-keys // kt)) // s) * kt
    hp = 1 << max(0, (heads - 1).bit_length())
    return {   # ×3: a pass's output, the pass loop's carried copy, and the top-k's input
        "maxima": batch * t_pad * (n_pad // g) * 4 * 3,
        "candidates": batch * t_pad * (tl["capacity"] + 2) * (8 * 3 + 1 + 4),   # + written mask, run edges
        "queries": batch * hp * t_pad * (head_dim * (4 + score_bytes) + 8),   # f32 padded, then cast
        "keys": batch * n_pad * (head_dim * (4 + score_bytes) + 8),
        "mask": batch * t_pad * -(-keys // block_size) if masked else 0,
        "counts": batch * s * t_pad * 4 * 8,   # thresholds, offsets and per-split counts with copies
        "level1": batch * t_pad * (keep_blocks * 8 + -(-keys // block_size)) if keep_blocks else 0,
    }


def launch_rows(batch: int, rows: int, keys: int, k: int, *, budget: int, **kw) -> int:
    """Query rows per launch: all ``rows`` if one launch's row-dependent scratch (everything but the keys'
    operands) fits ``budget``, else the largest rows / 2^i that does (at least 16)."""
    def row_bytes(n: int) -> int:
        ws = workspace_bytes(batch, n, keys, k, **kw)
        return sum(ws.values()) - ws["keys"]

    n = rows
    while n > 16 and row_bytes(n) > budget:
        n = max(16, -(-n // 2))
    return n
