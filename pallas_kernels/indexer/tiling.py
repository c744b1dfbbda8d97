"""The indexer kernel's static tiling and HBM workspace (pure Python: the planner imports it without JAX)."""

from __future__ import annotations

TARGET_PROGRAMS = 264  # H200: 132 SMs; split the keys until about two waves of programs run
SMS = 132              # H200 streaming multiprocessors: a launch's programs are split into whole waves of them
RESCORE_TILE = 128     # candidates a rescore program gathers and scores (one MMA of [H, d] × [d, 128])
SELECT_MAX = 8192      # longest row kernel.top_k_indices selects in one program (longer: piece by piece)
SELECT_BITS = 1        # bits of the K-th value kernel._select_kernel decides a step (1 measured best on the mix)
SUPER_GROUPS = 8       # groups per super-group in kernel.best_groups (8 measured faster than 16 and 32)
ROW_PROGRAM_MAX = 8    # launches of at most this many rows a sequence (decode) score one row a program
GROUP = 8              # keys a group maximum stands for (rows too short to need it score every key)


def tiling(batch: int, rows: int, keys: int, k: int, *, keep_blocks: int = 0, block_size: int = 1,
           block_rows=None, key_tile=None, group=None, splits=None, num_warps=None, num_stages=None) -> dict:
    """The kernel's tiling for one launch of ``batch`` × ``rows`` query rows against ``keys`` keys.

    block_rows: query rows per program: 1 for ≤ ROW_PROGRAM_MAX rows (``kernel._row_maxima_kernel``: the row's
    heads are the MMA's rows, where a block of 16 rows would be mostly padding), 16 for ≤ 16 rows, else 64 (else
    ≥ 16 for the MMA); key_tile: 128 keys (each key tile re-reads the block's q for all heads, so wider tiles
    read q less per FLOP); group: keys per maximum (B_c for the candidate source, else GROUP; 1 when the key
    buffer holds at most K of those groups — a cache sized for a short context —: all would be rescored, so the
    pass keeps every key's score instead; the choice is static, by the buffer, not the visible keys); splits: key
    splits per row block so that at least TARGET_PROGRAMS programs run, in whole waves (``key_splits``; few for a
    2,048-row prefill; many for decode); num_warps 4, num_stages 3 (the key tiles' copy pipeline). Defaults: the
    fastest of a sweep (measured: see docs/BENCHMARKS.md, section "Indexer: one score pass, the best groups
    rescored"). candidates: keys rescored per row, min(K, groups)·G (kernel.py)."""
    br = block_rows or (1 if rows <= ROW_PROGRAM_MAX else 16 if rows <= 16 else 64)
    kt = key_tile or 128
    g = block_size if keep_blocks else (group or GROUP)
    if kt % g or g & (g - 1) or kt & (kt - 1) or br & (br - 1) or 1 < br < 16 or kt < 16:
        raise ValueError(f"indexer kernel tiling: block_rows {br} (1, or a power of two ≥ 16) and key_tile "
                         f"{kt} (a power of two ≥ 16) must fit, and the group {g} be a power of two dividing "
                         "key_tile")
    if (keep_blocks or not group) and -(-keys // g) <= k:   # every group would be rescored: keep every score
        g = 1
    tiles = max(1, -(-keys // kt))
    blocks = batch * -(-rows // br)
    s = min(splits or key_splits(blocks, tiles), tiles)
    kk = max(1, min(k, keys))
    return {"block_rows": br, "key_tile": kt, "group": g, "splits": s,
            "num_warps": num_warps or 4, "num_stages": num_stages or 3,
            "candidates": min(kk, -(-keys // g)) * g}


def key_splits(blocks: int, tiles: int) -> int:
    """Key splits per row block: at least TARGET_PROGRAMS programs in all (up to one split per key tile), and
    of the split counts up to twice that, the one whose programs fill their last wave of SMS best (the fewest
    splits among equals). Every program of a long-context launch walks about as many tiles, so a launch
    lasts as many program-times as it has waves: a launch a few programs past whole waves pays a whole extra
    wave (measured: see docs/BENCHMARKS.md, section "Indexer launches in whole waves")."""
    least = max(1, min(tiles, -(-TARGET_PROGRAMS // blocks)))

    def filled(s: int) -> float:
        programs = blocks * s
        return programs / (-(-programs // SMS) * SMS)

    return max(range(least, min(tiles, 2 * least) + 1), key=lambda s: (filled(s), -s))


def workspace_bytes(batch: int, rows: int, keys: int, k: int, *, heads: int, head_dim: int, keep_blocks: int = 0,
                    block_size: int = 1, masked: bool = False, score_bytes: int = 2) -> dict[str, int]:
    """HBM scratch of one launch of ``rows`` query rows (role -> bytes), an upper bound of what the op
    allocates beside its inputs and output: the group maxima (the pass's output and lax.top_k's copy and
    chosen groups; the candidate source's level-1 mask works on the same maxima), the candidates (key indices,
    rescored scores, the final top-k's input and picks), the MMA operands of the rows (q, w, both passes) and
    of the keys (``keys``: per call, not per launch), the candidate mask as int8, and for the candidate source
    lax.top_k's K_B block picks and the kept mask."""
    tl = tiling(batch, rows, keys, k, keep_blocks=keep_blocks, block_size=block_size)
    br, kt, g, s = tl["block_rows"], tl["key_tile"], tl["group"], tl["splits"]
    t_pad = -(-rows // br) * br
    n_pad = s * -(-max(1, -(-keys // kt)) // s) * kt
    hp = 1 << max(0, (heads - 1).bit_length())
    c = -(-tl["candidates"] // RESCORE_TILE) * RESCORE_TILE
    return {
        "maxima": batch * t_pad * (n_pad // g) * 4 * 2 + batch * rows * k * 8,
        "candidates": batch * rows * c * (4 * 4),
        "queries": batch * max(16, hp) * t_pad * (head_dim * (4 + score_bytes + 2) + 16),   # f32, cast, bf16
        "keys": batch * n_pad * (head_dim * (4 + score_bytes + 2) + 8),
        "mask": batch * t_pad * -(-keys // block_size) if masked else 0,
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
