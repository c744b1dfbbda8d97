"""The segment plan by the shape rules (PLANNER.md §B.2): one segment on one rank, its MoE blocks, index paths,
workspace (``plan_shape``); the buffer plan, the role-wise maximum over the programs the engine can issue
(``buffer_plan``); decode windows (§B.3a); the kernel tiles the engine runs with (``kernel_tiles``). The memory
rules on top of these (R10, R6) are `memory`'s."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from dsv41_jax.config import ModelConfig
from pallas_kernels.indexer.tiling import launch_rows as index_kernel_rows
from pallas_kernels.indexer.tiling import tiling as index_kernel_tiling
from pallas_kernels.indexer.tiling import workspace_bytes as index_kernel_workspace

from .admission import Admission, admit
from .options import (
    KEY_TILE,
    MOE_TILE,
    RESCORE_BYTES_PER_KEY,
    ROPE_EXTRA,
    ROUTER_ROWS,
    SHORT_ROWS,
    STREAM_BUDGET,
    STREAM_SPLIT_KEYS,
    MemoryBudget,
    MiB,
    PlanOptions,
    PlanRefused,
    context_limit,
    prefill_rows,
)
from .rules import check_position, check_shape, decoder_start, segment_label
from .sizes import cache_pool_bytes, fp8_partial_sums_bytes, kv_row_bytes, weight_bytes


@dataclass(frozen=True)
class IndexPath:
    """The selection path of one index layer for one segment (§B-3); ``scratch_bytes`` per launch."""

    layer: int
    kind: str  # all_visible | small_window | materialised | streamed | rescoring
    visible: int  # visible keys at the segment's end
    rows_per_launch: int
    launches: int
    splits: int
    scratch_bytes: int


@dataclass(frozen=True)
class ReplayPart:
    """CED bounded replay facts for this segment (§A, R8)."""

    decoder_start: int  # first decoder layer (first ratio-1 layer, a kv source)
    tail_rows: int  # decoder tail m = n − 1 − R0 ≤ window − 1
    stash_rows: int  # CED stash (window rows, keeps window − 1)


@dataclass(frozen=True)
class SegmentPlan:
    """One segment on one rank (§B.2). Byte fields are per rank."""

    world: int
    rank: int
    rows: int
    start: int
    part: str
    prefill_rows: int
    pf4k: bool
    short: bool
    staged: bool
    ring_rows: int  # slot SWA ring (256 full model) or the staging ring (4,096 / 8,192)
    slot_ring_rows: int
    rope_rows: int
    heads_per_rank: int
    head_tile: int  # BMQ
    attention_grid: int  # ⌈H_l / BMQ⌉
    key_tile: int
    output_groups: int
    expert_width: int  # this rank's real width I_r
    expert_width_padded: int
    vocab_rows: int  # this rank's real V_r
    moe_strategy: str  # bounded | whole | halving
    moe_pairs: int  # P = n · k
    moe_blocks: int
    moe_block_tokens: int  # rows in one x3gm block
    moe_block_rows: int  # assignments in one block (rows × top-k)
    moe_bound_floats: int  # zb = R_e (k+1) max(8 I, D) (R5)
    router_launches: int
    index_paths: tuple[IndexPath, ...]
    image_rows: int | None  # -1: image MoE call sized at the full n rows (§A); None without images
    image_keep: bool
    replay: ReplayPart | None
    spans: tuple[int, ...]
    exchanges: int
    exchange_bytes: int
    workspace: tuple[tuple[str, int], ...]  # (role, bytes)
    cache_bytes: int  # KV pool + window rings held on this rank
    weight_bytes: int
    total_bytes: int  # weights + workspace + cache (reserve not included)

    @property
    def workspace_bytes(self) -> dict[str, int]:
        return dict(self.workspace)

    @property
    def workspace_total(self) -> int:
        return sum(b for _, b in self.workspace)

    def to_json(self) -> dict:
        """A JSON-ready dict (the CLI's --json)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("workspace", "index_paths",
                                                                                  "replay")}
        out["workspace_bytes"] = self.workspace_bytes
        out["workspace_total"] = self.workspace_total
        out["index_paths"] = [ip.__dict__ for ip in self.index_paths]
        out["replay"] = self.replay.__dict__ if self.replay else None
        out["spans"] = list(self.spans)
        return out


# =============================================================================================== plan_shape
def plan_shape(cfg: ModelConfig, world: int, rank: int, rows: int, position: int,
               options: PlanOptions = PlanOptions(), budget: MemoryBudget | None = None) -> SegmentPlan:
    """Plan ``rows`` rows starting at ``position`` on ``rank`` of ``world`` by the shape rules, or raise
    `PlanRefused`; ``budget`` sizes the plan's KV pool only (the memory rules: `memory.plan_segment`).

    Rules are applied with every rank's widths (§B.2 step 3): a shape is accepted only if all ranks accept it.
    """
    adm = admit(cfg, world, block=options.block, uneven=options.uneven)
    if not 0 <= rank < world:
        raise PlanRefused("admission", f"rank {rank} is outside world {world} (ranks 0..{world - 1}).")
    check_shape(cfg, adm, rank, rows, position, options)
    order = [rank] + [r for r in range(world) if r != rank]
    plans = {r: _plan_rank(cfg, adm, r, rows, position, options, budget) for r in order}
    return plans[rank]




# ----------------------------------------------------------------------------------------------- per rank
def _plan_rank(cfg: ModelConfig, adm: Admission, rank: int, n: int, start: int, options: PlanOptions,
               budget: MemoryBudget | None) -> SegmentPlan:
    rows_mode = prefill_rows(options)
    slot_ring, ring, staged = ring_rows(cfg, n, rows_mode)
    moe = _plan_moe(cfg, adm, rank, n, start, options)
    index = tuple(index_paths(cfg, n, start, options))
    part = "encoder" if options.replay and options.part == "whole" else options.part
    replay = _replay_part(cfg, n, part) if options.replay or part != "whole" else None
    workspace = _workspace(cfg, adm, rank, n, options, moe, index, staged, ring, replay is not None)
    weights = weight_bytes(cfg, adm.world, rank, options)
    cache = cache_pool_bytes(cfg, adm.world, options, budget)
    exchanges = 2 * cfg.num_hidden_layers + len(cfg.engram_layer_ids)
    return SegmentPlan(
        world=adm.world, rank=rank, rows=n, start=start, part=part, prefill_rows=rows_mode, pf4k=options.pf4k,
        short=n <= SHORT_ROWS, staged=staged, ring_rows=ring, slot_ring_rows=slot_ring,
        rope_rows=context_limit(cfg, options) + ROPE_EXTRA,
        heads_per_rank=adm.heads_per_rank, head_tile=adm.head_tile, attention_grid=adm.attention_grid,
        key_tile=KEY_TILE, output_groups=adm.groups_per_rank,
        expert_width=adm.expert_widths[rank], expert_width_padded=adm.expert_width_padded,
        vocab_rows=adm.vocab_rows[rank], **moe,
        router_launches=-(-n // ROUTER_ROWS), index_paths=index,
        image_rows=-1 if options.images else None, image_keep=options.images and bool(cfg.engram_layer_ids),
        replay=replay, spans=options.spans, exchanges=exchanges,
        exchange_bytes=2 * cfg.num_hidden_layers * (adm.world - 1) * n * cfg.hidden_size * 2,
        workspace=workspace, cache_bytes=cache, weight_bytes=weights,
        total_bytes=weights + cache + sum(b for _, b in workspace),
    )


def ring_rows(cfg: ModelConfig, n: int, rows_mode: int) -> tuple[int, int, bool]:
    """(slot ring, ring used, staged) — R3: ring ≥ n + W_n − 1; the slot ring is 2·W_n (256 full model)."""
    wn = cfg.sliding_window
    slot = 2 * wn
    if n + wn - 1 <= slot:
        return slot, slot, False
    staging = _ceil_pow2(rows_mode + wn - 1)
    assert staging >= n + wn - 1  # R3 holds by construction (R1 keeps n ≤ prefill_rows)
    return slot, staging, True


def _ceil_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def _replay_part(cfg: ModelConfig, n: int, part: str) -> ReplayPart:
    wn = cfg.sliding_window
    tail = n if part == "decoder" else n - 1 - max(0, n - wn)
    return ReplayPart(decoder_start=decoder_start(cfg), tail_rows=tail, stash_rows=wn)


# --------------------------------------------------------------------------------------------------- MoE
def moe_bound_floats(cfg: ModelConfig, width: int, expert_rows: int = 1024) -> int:
    """zb = R_e (k+1) max(8 I_r, D) floats: the decode expert scratch z (R5, §B-1)."""
    return expert_rows * (cfg.num_experts_per_tok + 1) * max(8 * width, cfg.hidden_size)


def _moe_width(adm: Admission, rank: int, options: PlanOptions) -> int:
    return adm.expert_width_padded if options.padded else adm.expert_widths[rank]


def _moe_strategy(cfg: ModelConfig, adm: Admission, n: int, options: PlanOptions) -> str:
    """auto: the decode-bounded block at W ≤ 2 in 2K mode (§E: it fits 2,048 rows of the full model, adding no
    byte), whole-block past W = 2 or in 4K mode — and whole-block wherever the bound does not hold on the
    widest rank (a small model whose expert width exceeds D), so "auto" never refuses R5."""
    if options.moe != "auto":
        if options.moe not in ("bounded", "whole", "halving"):
            raise PlanRefused("R5", f"MoE strategy {options.moe!r} is unknown: use auto, bounded, whole or halving.")
        return options.moe
    if adm.world > 2 or options.pf4k:
        return "whole"
    k, D, re, width = cfg.num_experts_per_tok, cfg.hidden_size, options.expert_rows, adm.expert_width_padded
    fits = n * k * D <= moe_bound_floats(cfg, width, re) and n * k * width <= re * (k + 1) * D
    return "bounded" if fits else "whole"


def _plan_moe(cfg: ModelConfig, adm: Admission, rank: int, n: int, start: int, options: PlanOptions) -> dict:
    """R5 / R5′: the x3gm block strategy, block count and block size (§E)."""
    k, D, re = cfg.num_experts_per_tok, cfg.hidden_size, options.expert_rows
    width = _moe_width(adm, rank, options)
    zb = moe_bound_floats(cfg, width, re)
    strategy = _moe_strategy(cfg, adm, n, options)
    block = n
    if strategy == "bounded":
        _check_bounded(cfg, adm, rank, n, start, zb, width, options)
    elif strategy == "halving":
        while block > 1 and (block * k * D > zb or block * k * width > re * (k + 1) * D):
            block = -(-block // 2)
    blocks = -(-n // block)
    return dict(moe_strategy=strategy, moe_pairs=n * k, moe_blocks=blocks, moe_block_tokens=block,
                moe_block_rows=block * k, moe_bound_floats=zb)


def _check_bounded(cfg: ModelConfig, adm: Admission, rank: int, n: int, start: int, zb: int, width: int,
                   options: PlanOptions) -> None:
    """R5: P·D ≤ zb and P·I_r ≤ R_e(k+1)D."""
    k, D, re = cfg.num_experts_per_tok, cfg.hidden_size, options.expert_rows
    pairs = n * k
    fit_rows = min(zb // (k * D), re * (k + 1) * D // (k * width))
    way_rows = 1 << (max(fit_rows, 1).bit_length() - 1)
    where = segment_label(adm, rank, n, start)
    if pairs * D > zb:
        extra = (4 * pairs * D - 4 * zb) / MiB
        raise PlanRefused("R5", f"{where}: x3gm block of {pairs:,} pairs needs {4 * pairs * D:,} B of expert "
                          f"scratch z; the plan holds {4 * zb:,} B (decode size, {re:,} rows). Plan whole-block "
                          f"MoE (+{extra:,.0f} MiB) or use {way_rows:,}-row segments.")
    if pairs * width > re * (k + 1) * D:
        need, have = 2 * pairs * width, 2 * re * (k + 1) * D
        raise PlanRefused("R5", f"{where}: x3gm block of {pairs:,} pairs needs {need:,} B of expert scratch xg "
                          f"({width:,} columns); the plan holds {have:,} B (decode size). Plan whole-block MoE "
                          f"(+{(need - have) / MiB:,.0f} MiB) or use {way_rows:,}-row segments.")


# ------------------------------------------------------------------------------------------- index paths
def index_paths(cfg: ModelConfig, n: int, start: int, options: PlanOptions) -> list[IndexPath]:
    """The selection path of every index layer the segment's part runs (§B-3)."""
    d = decoder_start(cfg)
    part = "encoder" if options.replay and options.part == "whole" else options.part
    out = []
    for layer in cfg.index_source_layer_ids:
        if part == "encoder" and d is not None and layer >= d:
            continue
        if part == "decoder" and d is not None and layer < d:
            continue
        out.append(_index_path(cfg, layer, n, start, options.index_budget, impl=options.indexer_impl,
                               limit=context_limit(cfg, options)))
    return out


def _index_path(cfg: ModelConfig, layer: int, n: int, start: int, budget: int,
                small_rows: int = SHORT_ROWS, impl: str = "reference", limit: int = 0) -> IndexPath:
    """``small_rows``: the most rows the small-window top-k takes (16 in prefill, 64 in decode windows);
    ``impl`` "pallas": the fused kernel over the index-key cache of a ``limit``-token context."""
    end = start + n
    if impl == "pallas":
        return _fused(cfg, layer, n, end, limit or cfg.max_position_embeddings, budget)
    if cfg.uses_candidates(layer):
        return _rescoring(cfg, layer, n, end, budget)
    visible = end // cfg.ratio(layer)
    candidate_source = layer == cfg.candidate_source_layer_id
    if visible <= cfg.index_topk:
        return IndexPath(layer, "all_visible", visible, n, 1, 1, 0)
    if n <= small_rows and n * visible * 12 <= budget:
        return IndexPath(layer, "small_window", visible, n, 1, 1, n * visible * 4)  # fp32 scores only
    if not candidate_source and n > SHORT_ROWS and visible >= 4096:
        return _streamed(cfg, layer, n, visible)
    # Materialised: fp32 score + int64 sort key = 12 B per (row, key); the candidate source adds a mask byte.
    per_key = 13 if candidate_source else 12
    st = n if n * visible * 12 <= budget else max(SHORT_ROWS, budget // (12 * visible))
    st = min(st, n)
    return IndexPath(layer, "materialised", visible, st, -(-n // st), 1, st * visible * per_key)


def _fused(cfg: ModelConfig, layer: int, n: int, end: int, limit: int, budget: int) -> IndexPath:
    """The fused scores + top-k kernel (pallas_kernels/indexer) over the whole index-key cache (⌈limit/r⌉
    keys: its group maxima are sized by the cache, its work by the visible keys), in launches of rows whose
    row-dependent scratch fits B_idx (``tiling.launch_rows``, as the model launches it); splits = key splits
    per row block; scratch = one launch's HBM workspace (``tiling.workspace_bytes``)."""
    r = cfg.ratio(layer)
    keys = -(-limit // r)
    source = layer == cfg.candidate_source_layer_id and cfg.candidate_topk_blocks > 0
    kw = dict(heads=cfg.index_n_heads, head_dim=cfg.index_head_dim, block_size=cfg.candidate_block_size,
              keep_blocks=cfg.candidate_topk_blocks if source else 0,
              masked=cfg.uses_candidates(layer) and cfg.candidate_topk_blocks > 0)
    rows = index_kernel_rows(1, n, keys, cfg.index_topk, budget=budget, **kw)
    work = index_kernel_workspace(1, rows, keys, cfg.index_topk, **kw)
    splits = index_kernel_tiling(1, rows, keys, cfg.index_topk, keep_blocks=kw["keep_blocks"],
                                 block_size=kw["block_size"])["splits"]
    return IndexPath(layer, "fused", min(end // r, keys), rows, -(-n // rows), splits, sum(work.values()))


def _streamed(cfg: ModelConfig, layer: int, n: int, visible: int) -> IndexPath:
    splits = -(-visible // STREAM_SPLIT_KEYS)
    per_row = splits * 2 * cfg.index_topk * 8  # per split: top-k partials (score + index), double-buffered
    rows = max(1, min(n, STREAM_BUDGET // per_row))
    return IndexPath(layer, "streamed", visible, rows, -(-n // rows), splits, rows * per_row)


def _rescoring(cfg: ModelConfig, layer: int, n: int, end: int, budget: int) -> IndexPath:
    keys = cfg.candidate_topk_blocks * cfg.candidate_block_size
    per_row = keys * RESCORE_BYTES_PER_KEY
    rows = n if n * per_row <= budget else max(1, min(n, budget // per_row))
    return IndexPath(layer, "rescoring", min(keys, end), rows, -(-n // rows), 1, rows * per_row)


# ------------------------------------------------------------------------------------------ decode windows
DECODE_HEAD_TILE = 16  # the decode attention's head tile (§B.3a), clamped like R4
DECODE_SMALL_ROWS = 64  # small-window top-k up to 64 rows (§B.3a)


@dataclass(frozen=True)
class DecodePlan:
    """A decode window of ``rows`` = slots × (1 + drafts) rows (§B.3a) on one rank."""

    world: int
    rank: int
    rows: int
    start: int
    row_path: bool  # m ≤ 16: row-path kernels (mHC, router narrow path); else the prefill tiles
    head_tile: int
    attention_grid: int
    moe_pairs: int  # m · (k + 1): the shared expert is a slot in decode
    index_paths: tuple[IndexPath, ...]


def plan_decode_window(cfg: ModelConfig, world: int, rank: int, rows: int, position: int,
                       options: PlanOptions = PlanOptions()) -> DecodePlan:
    """Plan a decode window (§B.3a) or raise `PlanRefused` (R2 position, R5 expert scratch).

    Planned only (``PLANNED_ONLY["decode_window"]``): the engine's decode step runs one row a sequence."""
    adm = admit(cfg, world, block=options.block, uneven=options.uneven)
    where = f"decode window refused (W = {world}, rank {rank}, m = {rows:,}, start {position:,})"
    if not 0 <= rank < world:
        raise PlanRefused("admission", f"rank {rank} is outside world {world} (ranks 0..{world - 1}).")
    check_position(cfg, options, rows, position, where)
    re = options.expert_rows
    if not 1 <= rows <= re:
        raise PlanRefused("R5", f"{where}: a decode window takes 1..{re:,} rows (P = m·(k+1) ≤ R_e·(k+1) pairs "
                          f"of the decode expert scratch). Run at most {re:,} rows, or plan it as a prefill segment.")
    tile = min(DECODE_HEAD_TILE, adm.heads_per_rank)
    paths = tuple(_index_path(cfg, layer, rows, position, options.index_budget, DECODE_SMALL_ROWS,
                              impl=options.indexer_impl, limit=context_limit(cfg, options))
                  for layer in cfg.index_source_layer_ids)
    return DecodePlan(world=world, rank=rank, rows=rows, start=position, row_path=rows <= SHORT_ROWS,
                      head_tile=tile, attention_grid=-(-adm.heads_per_rank // tile),
                      moe_pairs=rows * (cfg.num_experts_per_tok + 1), index_paths=paths)


# ---------------------------------------------------------------------------------------------- workspace
def activation_row_bytes(cfg: ModelConfig, world: int, width: int) -> int:
    """a(W): per-row activation bytes, *est.* (§B-4).

    64·D + 472: streams ×2, mHC partials, f32 routed and shared outputs, Engram rows, GEMM staging (the
    §B-4 constant 328,152 for D = 5,120); 4·D·W: two [W, n, D] bf16 exchange buffers; (4·H·hd + 2·G·R_o)/W:
    q and o at bf16 plus the wo_a outputs; 12·I_r: the shared expert's f32 gate, up and activation.
    """
    D, H, hd, G = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
    return 64 * D + 472 + 4 * D * world + (4 * H * hd + 2 * G * cfg.o_lora_rank) // world + 12 * width


def _workspace(cfg: ModelConfig, adm: Admission, rank: int, n: int, options: PlanOptions, moe: dict,
               index: tuple[IndexPath, ...], staged: bool, ring: int, replay: bool) -> tuple[tuple[str, int], ...]:
    """Role → bytes for this segment (§E workspace, §B-4). Scopes: s. persistent, w. segment, L. layer."""
    k, D, E, re = cfg.num_experts_per_tok, cfg.hidden_size, cfg.n_routed_experts, options.expert_rows
    width = _moe_width(adm, rank, options)
    block_pairs = moe["moe_block_rows"] if moe["moe_strategy"] == "whole" else 0
    vocab = adm.vocab_padded if options.padded else adm.vocab_rows[rank]
    roles = [
        ("w.activations", n * activation_row_bytes(cfg, adm.world, width)),
        ("L.moe.z", max(4 * moe["moe_bound_floats"], 4 * block_pairs * D)),
        ("L.moe.xg", max(2 * re * (k + 1) * D, 2 * block_pairs * width)),
        ("L.moe.xu", 2 * re * (k + 1) * D),
        ("L.moe.xd", 2 * re * (k + 1) * width),
        ("L.moe.plan", 4 * moe["moe_block_rows"] + 12 * (moe["moe_block_rows"] // MOE_TILE + E + 1)),
        ("L.router", min(n, ROUTER_ROWS) * E * 4),
        ("L.index.scratch", max((p.scratch_bytes for p in index), default=0)),
        ("w.index.topk", 2 * n * cfg.index_topk * 4),  # the ratio-2 and ratio-1 chains' live top-k lists
        ("s.staging_ring", ring * kv_row_bytes(cfg, options.kv) if staged else 0),
        ("s.ced_stash", cfg.sliding_window * stash_row_bytes(cfg) if replay else 0),
        ("w.head_logits", vocab * 4),  # the last row only
        # fp8 dense weights as stored: a decode-sized call's K-split partial sums (one projection at a time)
        ("L.fp8_splits", fp8_partial_sums_bytes(cfg, adm, rank, n, options.padded, options.dspark)
         if options.dense == "fp8" else 0),
    ]
    return tuple(roles)


def stash_row_bytes(cfg: ModelConfig) -> int:
    """A CED stash row: bf16 streams, bf16 normed input, f32 mHC coefficients (§A)."""
    return 2 * cfg.hc_mult * cfg.hidden_size + 2 * cfg.hidden_size + 4 * cfg.hc_mix_width



# ------------------------------------------------------------------------------------------ buffer plan
@dataclass(frozen=True)
class BufferPlan:
    """Role-wise maximum over the programs the engine can issue (§B.2); the 4K workspace separately."""

    world: int
    rank: int
    roles: tuple[tuple[str, int], ...]
    programs: tuple[tuple[str, int, int], ...]  # (part, rows, start) planned
    roles_4k: tuple[tuple[str, int], ...] = ()

    @property
    def bytes(self) -> dict[str, int]:
        return dict(self.roles)

    @property
    def total(self) -> int:
        return sum(b for _, b in self.roles)

    @property
    def total_4k(self) -> int:
        return sum(b for _, b in self.roles_4k)


def buffer_plan(cfg: ModelConfig, world: int, rank: int, options: PlanOptions = PlanOptions()) -> BufferPlan:
    """§B.2 buffer plan for ``rank``: programs (rows, 0 / last), (17, ·), (16, ·), replay's encoder segment
    and decoder passes; in 4K mode the resident plan is the 2K one and the 4K workspace is planned apart."""
    base = replace(options, pf4k=False, prefill_rows=None if options.pf4k else options.prefill_rows,
                   spans=(), tbo=False, part="whole")
    roles, programs = _role_max(cfg, world, rank, base)
    roles_4k: tuple[tuple[str, int], ...] = ()
    if options.pf4k:
        roles_4k, more = _role_max(cfg, world, rank, replace(options, spans=(), tbo=False, part="whole"))
        programs += more
    return BufferPlan(world, rank, roles, programs, roles_4k)


@functools.lru_cache(maxsize=128)
def _role_max(cfg: ModelConfig, world: int, rank: int, options: PlanOptions):
    limit = context_limit(cfg, options)
    rows = prefill_rows(options)
    shapes = [("whole", n) for n in sorted({rows, 17, 16}) if n <= rows]
    if options.replay:
        tail_max = cfg.sliding_window - 1
        tails = sorted({m for m in (16, 17, 32, 33, 64, 65, 127) if m <= tail_max} | {tail_max})
        shapes = [("encoder", n) for _, n in shapes] + [("decoder", m) for m in tails]
    best: dict[str, int] = {}
    programs = []
    for part, n in shapes:
        last = limit - n - (1 if part == "decoder" else 0)  # R2 is the only position-dependent refusal
        for start in sorted({0, max(0, last)}):
            opts = replace(options, part=part)
            plan = plan_shape(cfg, world, rank, n, start, opts)
            programs.append((part, n, start))
            for role, b in plan.workspace:
                best[role] = max(best.get(role, 0), b)
    return tuple(best.items()), tuple(programs)


# ------------------------------------------------------------------------------------------ kernel tiles
@dataclass(frozen=True)
class KernelTiles:
    """The tiles and scratch budgets the plan sizes and the kernels take as parameters (``ModelOptions.tiles``).

    ``attention_head_tile``: BMQ of a prefill segment (R4, ``sparse_attention(head_tile=)``);
    ``decode_head_tile``: the decode attention's (§B.3a); ``moe_block_m``: BM, pairs per x3gm tile (§E, the MoE
    kernel's ``KernelConfig.block_m``); ``index_budget``: B_idx, bytes of indexer scratch a launch of query rows
    may use (§B-3, ``pallas_kernels.indexer.tiling.launch_rows(budget=)``). The attention's key tile (KT, §D) is
    planned too (``SegmentPlan.key_tile``) but the attention op takes no key-tile parameter.
    """

    attention_head_tile: int
    decode_head_tile: int
    moe_block_m: int
    index_budget: int
    row_parallel_rows: int = 0  # segments of ≥ this many rows (a multiple of the world) split their per-row work

    def row_parallel(self, rows: int, world: int) -> bool:
        """Whether a segment of ``rows`` rows at ``world`` runs its HC mixes, collapses, norms and expands
        row-parallel (each rank T/P rows; the sublayer inputs gathered for attention and the MoE)."""
        return world > 1 and 0 < self.row_parallel_rows <= rows and rows % world == 0


def kernel_tiles(cfg: ModelConfig, world: int, options: PlanOptions = PlanOptions()) -> KernelTiles:
    """The kernel tiles of every segment and decode step at ``world`` (the same on every rank: heads split
    evenly, R4)."""
    adm = admit(cfg, world, block=options.block, uneven=options.uneven)
    return KernelTiles(attention_head_tile=adm.head_tile,
                       decode_head_tile=min(DECODE_HEAD_TILE, adm.heads_per_rank),
                       moe_block_m=MOE_TILE, index_budget=options.index_budget,
                       row_parallel_rows=options.row_parallel_rows if world > 1 else 0)
