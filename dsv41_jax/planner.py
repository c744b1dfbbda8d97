"""The static planner (PLANNER.md §B): every segment shape planned and sized before anything runs.

Pure Python (no JAX at import or at call): the same inputs give the same plan on every rank.

* `admit` splits heads, output groups, expert width and vocabulary over a tensor-parallel world (§C) and says
  how each rank's shard sits inside the evenly padded layout JAX shards.
* `plan_segment` plans one segment (rows, starting position) on one rank, or raises `PlanRefused` naming the
  rule of §B.3 that failed, the numbers, the rank that binds and the way out.
* `buffer_plan` is the role-wise maximum over the programs the engine can issue (§B.2); `segment_sizes` is how
  the engine cuts a prompt; `param_bytes_per_rank`, `kv_bytes` and `max_context` are the memory side (§F).

Split granularity (§C, decided here). Widths are cut into ``block``-wide blocks (default 128: kernel tiles and
the reference's Hadamard blocks); ranks r < s get q + 1 blocks, the rest q (``q, s = divmod(blocks, world)``).
When the width is not a multiple of the block, or has fewer blocks than ranks (a rank would own nothing), the
block is halved until it fits, never below 32 — the quantisation group (fp8 32×32 scale blocks, fp4 per-32
scales), so a cut never splits a scale group. The full model never falls back (2,304 = 18 × 128 columns,
129,280 = 1,010 × 128 rows: 640/640/512/512 at world 4, as §C requires); the tiny model's 256-wide experts
fall back to 64 at world 4 and 32 at world 8 (64 / 32 columns a rank, MODEL.md §A.3).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from dsv41_jax.config import ModelConfig
from pallas_kernels.indexer.tiling import launch_rows as index_kernel_rows
from pallas_kernels.indexer.tiling import tiling as index_kernel_tiling
from pallas_kernels.indexer.tiling import workspace_bytes as index_kernel_workspace

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

WORLDS = (1, 2, 4, 8)  # the tensor-parallel worlds the engine runs (MODEL.md §F.1)
SHORT_ROWS = 16  # rows ≤ 16: short segment, decode-kernel row paths (§A)
CAP_2K, CAP_4K = 2048, 4096  # R1 caps
MIN_BLOCK = 32  # the smallest split block: the quantisation group (§C)
BMQ_MAX = 32  # attention head tile (R4)
KEY_TILE = 32  # KT, keys per attention tile (§D)
MOE_TILE = 64  # BM, pairs per x3gm tile (§E)
ROUTER_ROWS = 2048  # router launch size (§E)
ROPE_EXTRA = 2048  # rope table rows past the limit (R2)
STREAM_SPLIT_KEYS = 16384  # streamed selection: keys per split (§B-3)
STREAM_BUDGET = 256 * MiB  # streamed selection scratch per launch (§B-3)
INDEX_BUDGET = 256 * MiB  # B_idx: indexer scratch for one block of query rows (the model's row blocks obey it)
RESCORE_BYTES_PER_KEY = 16  # candidate rescoring (§B-3)
TBO_MIN_ROWS = 512  # R9


class PlanRefused(Exception):
    """A refusal: ``rule`` is the §B.3 / §C id ("R1".."R10", "admission"), ``message`` says what, the
    numbers, the rank that binds and the way out."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"{rule}: {message}")
        self.rule = rule
        self.message = message


# ================================================================================================ admission
@dataclass(frozen=True)
class Split:
    """One dimension of ``sum(sizes)`` entries cut over ranks (§C): rank r owns ``sizes[r]`` contiguous entries,
    in ``block``-wide blocks (1: any width).

    Real layout: rank r owns entries ``[start(r), start(r) + sizes[r])``. Padded layout (JAX even sharding):
    every shard is ``shard`` wide (the widest rank's size), rank r's real entries come first in its shard and the
    rest is zero padding; the padded total is ``world × shard``. The planner cuts the admission's splits
    (`split_blocks`); ``sharding.layout`` places tensors with them (``shard_of``: numpy, imported on call, so
    the planner stays free of array libraries at import).
    """

    sizes: tuple[int, ...]
    block: int = 1

    @staticmethod
    def even(total: int, world: int) -> "Split":
        if total % world:
            raise ValueError(f"{total} does not split evenly over {world} ranks")
        return Split((total // world,) * world)

    @staticmethod
    def padded(total: int, world: int) -> "Split":
        """``total`` entries over ``world`` ranks, ⌈total / world⌉ a rank in order (the last ones may hold fewer,
        or none): zero-padded where the world does not divide ``total``."""
        each = -(-total // world)
        return Split(tuple(min(each, max(total - r * each, 0)) for r in range(world)))

    @property
    def world(self) -> int:
        return len(self.sizes)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def shard(self) -> int:
        """Every rank's padded shard width (the widest rank's)."""
        return max(self.sizes)

    @property
    def padded_total(self) -> int:
        return self.shard * self.world

    @property
    def is_padded(self) -> bool:
        return self.padded_total != self.total

    def start(self, rank: int) -> int:
        return sum(self.sizes[:rank])

    def grouped(self, group: int) -> "Split":
        """The same split counted in groups of ``group`` entries (fp4 bytes: 2 codes, or 32 inputs a scale)."""
        if any(n % group for n in self.sizes):
            raise ValueError(f"per-rank widths {self.sizes} do not split into whole groups of {group}")
        return Split(tuple(n // group for n in self.sizes), max(self.block // group, 1))

    def real_range(self, rank: int) -> tuple[int, int]:
        """Rank's entries in the unpadded (checkpoint) layout: [start, stop)."""
        start = self.start(rank)
        return start, start + self.sizes[rank]

    def padded_range(self, rank: int) -> tuple[int, int]:
        """Where rank's real entries sit in the padded layout: [start, stop); [stop, (rank+1)·shard) is padding."""
        start = rank * self.shard
        return start, start + self.sizes[rank]

    def padded_index(self) -> list[int]:
        """For each of the ``padded_total`` positions, the real entry it holds, or -1 for padding.

        Gathering a checkpoint tensor with it (and zeroing the -1 positions) gives the padded layout.
        """
        out: list[int] = []
        for r in range(self.world):
            lo, hi = self.real_range(r)
            out += list(range(lo, hi)) + [-1] * (self.shard - (hi - lo))
        return out

    def real_index(self):
        """For each real entry (in order), its position in the padded dimension: numpy int32 ``[total]``."""
        import numpy as np  # noqa: PLC0415 - host arrays for the sharded loader only

        return np.concatenate([r * self.shard + np.arange(n) for r, n in enumerate(self.sizes)]).astype(np.int32)

    def shard_of(self, array, axis: int, rank: int):
        """Rank ``rank``'s real slice of ``array`` along ``axis``, zero-padded (on the host) to ``shard`` entries.

        ``array``: anything with basic slicing (numpy, a memory map, a lazily read ``load.CheckpointTensor``):
        only the rank's real range is asked for, so a lazy source reads just those rows; the padding is added to
        what came back.
        """
        import numpy as np  # noqa: PLC0415 - host arrays for the sharded loader only

        lo, hi = self.real_range(rank)
        take = np.asarray(array[(slice(None),) * axis + (slice(lo, hi),)])
        missing = self.shard - self.sizes[rank]
        if not missing:
            return take
        pad = [(0, 0)] * take.ndim
        pad[axis] = (0, missing)
        return np.pad(take, pad)

    def pad_full(self, array, axis: int):
        """The whole padded array (host memory; for tests and small tensors)."""
        import numpy as np  # noqa: PLC0415 - host arrays for the sharded loader only

        return np.concatenate([self.shard_of(array, axis, r) for r in range(self.world)], axis=axis)


def split_blocks(total: int, world: int, *, block: int = 128, uneven: bool = True,
                 what: str = "width") -> Split:
    """Cut ``total`` over ``world`` ranks in blocks (§C); refuse (rule "admission") when no block ≥ 32 fits."""
    g = block
    while g >= MIN_BLOCK and (total % g or total // g < world):
        g //= 2  # fallback: a rank would own nothing, or the width is not whole blocks (module docstring)
    if g < MIN_BLOCK:
        raise PlanRefused("admission", f"world {world} refused: {what} {total:,} cannot be cut into {world} "
                          f"shards of whole {MIN_BLOCK}-column blocks (tried blocks {block} down to {MIN_BLOCK}). "
                          f"Use a smaller world.")
    blocks = total // g
    q, s = divmod(blocks, world)
    if s and not uneven:
        raise PlanRefused("admission", f"world {world} refused: {what} {total:,} is {blocks} blocks of {g}, "
                          f"which {world} ranks cannot share evenly, and block splitting is off. Turn it on "
                          f"({_describe_widths(_uneven_widths(blocks, world, g))}) or use a world dividing "
                          f"{blocks}.")
    return Split(_uneven_widths(blocks, world, g), g)


def _uneven_widths(blocks: int, world: int, g: int) -> tuple[int, ...]:
    q, s = divmod(blocks, world)
    return tuple((q + 1 if r < s else q) * g for r in range(world))


def _describe_widths(widths: tuple[int, ...]) -> str:
    return "/".join(f"{w:,}" for w in widths)


@dataclass(frozen=True)
class Admission:
    """What each rank of a world owns (§C, MODEL.md §F)."""

    world: int
    heads_per_rank: int  # H_l
    groups_per_rank: int  # G_l (wo_a output groups)
    head_tile: int  # BMQ = min(32, H_l) (R4)
    expert_split: Split  # routed and shared expert width
    vocab_split: Split  # embed / head rows

    @property
    def expert_widths(self) -> tuple[int, ...]:
        return self.expert_split.sizes

    @property
    def vocab_rows(self) -> tuple[int, ...]:
        return self.vocab_split.sizes

    @property
    def expert_width_padded(self) -> int:
        return self.expert_split.shard

    @property
    def vocab_padded(self) -> int:
        return self.vocab_split.shard

    @property
    def attention_grid(self) -> int:
        return -(-self.heads_per_rank // self.head_tile)

    @property
    def widest_rank(self) -> int:
        """The first rank with the widest expert shard (binds memory and time, §C)."""
        widths = self.expert_widths
        return widths.index(max(widths))

    def expert_columns(self, rank: int) -> tuple[int, int]:
        """Rank's real expert columns inside the padded layout (§C; padding is zero w1/w3 rows, w2 columns)."""
        return self.expert_split.padded_range(rank)

    def vocab_slice(self, rank: int) -> tuple[int, int]:
        """Rank's real vocabulary rows inside the padded layout."""
        return self.vocab_split.padded_range(rank)


def admit(cfg: ModelConfig, world: int, *, block: int = 128, uneven: bool = True) -> Admission:
    """Admit ``world`` for ``cfg`` or raise `PlanRefused` (R4 for heads/groups, "admission" for widths)."""
    H, G = cfg.num_attention_heads, cfg.o_groups
    if world < 1 or H % world or G % world:
        raise PlanRefused("R4", f"world {world} refused: {H} heads in {G} output groups of {H // G} cannot be "
                          f"split over {world} ranks (each rank must own whole groups). Use a world dividing "
                          f"{G} (e.g. {_divisors_up_to(G)}).")
    h_l, g_l = H // world, G // world
    return Admission(
        world=world, heads_per_rank=h_l, groups_per_rank=g_l, head_tile=min(BMQ_MAX, h_l),
        expert_split=split_blocks(cfg.moe_intermediate_size, world, block=block, uneven=uneven,
                                  what="expert width"),
        vocab_split=split_blocks(cfg.vocab_size, world, block=block, uneven=uneven, what="vocabulary"),
    )


def _divisors_up_to(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


# ================================================================================================== options
@dataclass(frozen=True)
class PlanOptions:
    """Planner options (§B.1). ``None`` fields take their mode's default."""

    prefill_rows: int | None = None  # 2K mode: 16-row grid, 32..2,048 (default 2,048); 4K mode: 4,096
    pf4k: bool = False  # 4K mode (R6)
    acknowledge_4k: bool = False  # the explicit memory acknowledgement 4K mode needs
    replay: bool = False  # CED bounded replay (§A); part "whole" then plans the encoder segment
    part: str = "whole"  # "whole" | "encoder" | "decoder" (a decoder tail pass of ≤ window−1 rows)
    images: bool = False  # image roles planned: image_keep, image_rows = -1 (§A)
    spans: tuple[int, ...] = ()  # multi-span: per-span rows, summing to the segment's rows (R7)
    split_kv: bool = False  # compressed rows split over ranks (§F)
    tbo: bool = False  # two-batch overlap (R9)
    moe: str = "auto"  # "auto" | "bounded" | "whole" | "halving" (§E)
    index_budget: int = INDEX_BUDGET  # B_idx
    indexer_impl: str = "reference"  # "pallas": every index layer takes the fused kernel's path ("fused")
    context_limit: int | None = None  # None: the model's max_position_embeddings
    slots: int = 1  # concurrent requests (window rings, default KV pool)
    expert_rows: int = 1024  # R_e, decode expert-scratch rows
    block: int = 128  # split granularity (§C)
    uneven: bool = True  # allow q+1/q block splits (§C)
    experts: str = "bf16"  # routed expert weights: f32 | bf16 | fp8 | fp4
    dense: str = "bf16"  # other weights: f32 | bf16 | fp8 (embed/head stay 16-bit)
    kv: str = "fp8"  # compressed rows: fp8 (584 B full model) | bf16
    index_keys: str = "fp8"  # fp8 (132 B) | fp4 (68 B)
    padded: bool = True  # size expert/vocab shards at the padded (widest) width, as JAX allocates them
    engram_tables: str = "host"  # engram tables: "host" (memory-mapped, §F: the default) | "device"
    vision_images: int = 1  # with ``images``: images one tower call encodes, each planned at the largest bucket


@dataclass(frozen=True)
class MemoryBudget:
    """Per-device memory (§F). ``reserve_bytes`` excludes the prefill workspace, which the buffer plan sizes."""

    usable_bytes: int = 139 * GiB
    reserve_bytes: int = 11 * GiB // 2  # context+collectives 1.5, decode windows/graphs 2, fragmentation 2 (§F)
    kv_tokens: int | None = None  # KV pool in tokens; None: slots × context limit (one full request a slot)
    floor_4k_bytes: int = 0  # the 4K workspace must leave this much free (R6)

    @classmethod
    def gib(cls, usable: float, **kw) -> "MemoryBudget":
        return cls(usable_bytes=int(usable * GiB), **kw)


def context_limit(cfg: ModelConfig, options: PlanOptions) -> int:
    return options.context_limit or cfg.max_position_embeddings


def prefill_rows(options: PlanOptions) -> int:
    """The segment size the engine cuts prompts into (§A)."""
    if options.prefill_rows is not None:
        return options.prefill_rows
    return CAP_4K if options.pf4k else CAP_2K


# ==================================================================================================== plans
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


# ============================================================================================= plan_segment
def plan_segment(cfg: ModelConfig, world: int, rank: int, rows: int, position: int,
                 options: PlanOptions = PlanOptions(), budget: MemoryBudget | None = None) -> SegmentPlan:
    """Plan ``rows`` rows starting at ``position`` on ``rank`` of ``world``, or raise `PlanRefused`.

    Rules are applied with every rank's widths (§B.2 step 3): a shape is accepted only if all ranks accept it.
    """
    adm = admit(cfg, world, block=options.block, uneven=options.uneven)
    if not 0 <= rank < world:
        raise PlanRefused("admission", f"rank {rank} is outside world {world} (ranks 0..{world - 1}).")
    _check_shape(cfg, adm, rank, rows, position, options)
    order = [rank] + [r for r in range(world) if r != rank]
    plans = {r: _plan_rank(cfg, adm, r, rows, position, options, budget) for r in order}
    if budget is not None:
        _check_memory(cfg, adm, options, budget, rows, position)
    return plans[rank]


def _where(adm: Admission, rank: int, rows: int, start: int) -> str:
    return f"segment refused (W = {adm.world}, rank {rank}, n = {rows:,}, start {start:,})"


def _check_shape(cfg: ModelConfig, adm: Admission, rank: int, n: int, start: int,
                 options: PlanOptions) -> None:
    """R1, R2, R6, R7, R8, R9: the checks that do not depend on a rank's widths."""
    where = _where(adm, rank, n, start)
    _check_4k(options, where)
    _check_rows(cfg, options, n, where)
    _check_position(cfg, options, n, start, where)
    if options.replay or options.part != "whole":
        _check_replay(cfg, options, n, where)
    if options.spans:
        _check_spans(options, n, where)
    if options.tbo:
        _check_tbo(options, n, start, where)


def _check_4k(options: PlanOptions, where: str) -> None:
    if options.pf4k and not options.acknowledge_4k:
        raise PlanRefused("R6", f"{where}: 4K mode needs the explicit memory acknowledgement "
                          f"(a separate workspace of ~3 GiB a rank). Acknowledge it or leave 4K mode off.")
    rows = options.prefill_rows
    if options.pf4k and rows not in (None, CAP_4K):
        raise PlanRefused("R6", f"{where}: 4K mode runs 4,096-row segments exactly; prefill_rows {rows:,} "
                          f"was given. Drop the explicit size or leave 4K mode off.")
    if not options.pf4k and rows is not None and (rows % 16 or not 32 <= rows <= CAP_2K):
        raise PlanRefused("R1", f"{where}: prefill_rows {rows:,} is not on the 16-row grid 32..2,048. "
                          f"Use a multiple of 16 in that range, or 4K mode for 4,096.")


def _check_rows(cfg: ModelConfig, options: PlanOptions, n: int, where: str) -> None:
    cap = CAP_4K if options.pf4k else CAP_2K
    limit = min(prefill_rows(options), cap)
    if 1 <= n <= limit:
        return
    if n < 1:
        raise PlanRefused("R1", f"{where}: a segment needs at least 1 row.")
    if n <= CAP_4K and not options.pf4k:
        way = f"split into {-(-n // limit)} × {limit:,}-row segments, or turn on 4K mode (4,096 rows)"
    else:
        way = f"split into {-(-n // CAP_2K)} × 2,048 or {-(-n // CAP_4K)} × 4,096"
    raise PlanRefused("R1", f"{where}: {n:,} rows exceed the segment cap {limit:,} "
                      f"({'4K' if options.pf4k else '2K'} mode). Way out: {way}.")


def _check_position(cfg: ModelConfig, options: PlanOptions, n: int, start: int, where: str) -> None:
    limit = context_limit(cfg, options)
    if limit > cfg.max_position_embeddings:
        raise PlanRefused("R2", f"{where}: context limit {limit:,} exceeds the model's "
                          f"{cfg.max_position_embeddings:,}. Lower the limit.")
    if start < 0 or start + n > limit:
        last = max(0, limit - n)
        raise PlanRefused("R2", f"{where}: rows [{start:,}, {start + n:,}) pass the context limit {limit:,}. "
                          f"Start at most at {last:,}, or end the request.")


def decoder_start(cfg: ModelConfig) -> int | None:
    """The first ratio-1 layer (§A replay), or None when the model has none."""
    for layer in range(cfg.num_hidden_layers):
        if cfg.ratio(layer) == 1:
            return layer
    return None


def _check_replay(cfg: ModelConfig, options: PlanOptions, n: int, where: str) -> None:
    """R8."""
    d = decoder_start(cfg)
    if d is None or d not in cfg.kv_source_layer_ids:
        raise PlanRefused("R8", f"{where}: replay needs its decoder to start at the first ratio-1 layer and that "
                          f"layer to be a kv source; layer {d} is not. Turn replay off.")
    late = [e for e in cfg.engram_layer_ids if e >= d]
    if late:
        raise PlanRefused("R8", f"{where}: replay needs no Engram layer at or after the decoder start {d}; "
                          f"Engram runs at {late}. Turn replay off.")
    tail_max = cfg.sliding_window - 1
    if options.part == "decoder" and n > tail_max:
        raise PlanRefused("R8", f"{where}: a decoder tail pass holds at most {tail_max} rows (the CED stash "
                          f"keeps window − 1); {n} were asked. Run at most {tail_max} rows.")


def _check_spans(options: PlanOptions, n: int, where: str) -> None:
    """R7."""
    floor = 32 if options.part == "decoder" else SHORT_ROWS
    small = [s for s in options.spans if s <= floor]
    cap = min(prefill_rows(options), CAP_4K if options.pf4k else CAP_2K)
    problems = []
    if small:
        problems.append(f"spans {small} are ≤ {floor} rows (merge them or run them alone)")
    if sum(options.spans) != n or n > cap:
        problems.append(f"spans sum to {sum(options.spans):,} for a {n:,}-row segment (cap {cap:,})")
    if options.images:
        problems.append("image rows cannot be multi-span (plan them as their own segment)")
    if options.split_kv:
        problems.append("split KV cannot be multi-span (turn split KV off)")
    if problems:
        raise PlanRefused("R7", f"{where}: multi-span refused: " + "; ".join(problems) + ".")


def _check_tbo(options: PlanOptions, n: int, start: int, where: str) -> None:
    """R9: two micro-batches ≥ 512 rows, even start and first-batch size, no split KV, no images."""
    first = (n // 2) & ~1
    problems = []
    if min(first, n - first) < TBO_MIN_ROWS:
        problems.append(f"micro-batches {first:,} + {n - first:,} rows, each needs ≥ {TBO_MIN_ROWS}")
    if start % 2:
        problems.append(f"start {start:,} is odd (a ratio-2 pair would straddle the batches)")
    if options.split_kv:
        problems.append("split KV is on")
    if options.images:
        problems.append("image rows are planned")
    if problems:
        raise PlanRefused("R9", f"{where}: two-batch overlap refused: " + "; ".join(problems)
                          + ". Turn TBO off for this segment.")


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
    weights = _weight_bytes(cfg, adm.world, rank, options)
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
    where = _where(adm, rank, n, start)
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
    """Plan a decode window (§B.3a) or raise `PlanRefused` (R2 position, R5 expert scratch)."""
    adm = admit(cfg, world, block=options.block, uneven=options.uneven)
    where = f"decode window refused (W = {world}, rank {rank}, m = {rows:,}, start {position:,})"
    if not 0 <= rank < world:
        raise PlanRefused("admission", f"rank {rank} is outside world {world} (ranks 0..{world - 1}).")
    _check_position(cfg, options, rows, position, where)
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
    ]
    return tuple(roles)


def stash_row_bytes(cfg: ModelConfig) -> int:
    """A CED stash row: bf16 streams, bf16 normed input, f32 mHC coefficients (§A)."""
    return 2 * cfg.hc_mult * cfg.hidden_size + 2 * cfg.hidden_size + 4 * cfg.hc_mix_width


# ================================================================================================= memory
def kv_row_bytes(cfg: ModelConfig, kv: str = "fp8") -> int:
    """A compressed / window row: fp8 = nope e4m3 + rope bf16 + 8 scale bytes (584 B full model); bf16 = 2·hd."""
    if kv == "bf16":
        return 2 * cfg.head_dim
    if kv == "fp8":
        return (cfg.head_dim - cfg.rope_dim) + 2 * cfg.rope_dim + 8
    raise PlanRefused("admission", f"KV row format {kv!r} is unknown: use fp8 or bf16.")


def index_key_bytes(cfg: ModelConfig, keys: str = "fp8") -> int:
    """An index key: fp8 = d_I + f32 scale (132 B full model), fp4 = d_I/2 + 4 (68 B)."""
    if keys == "fp8":
        return cfg.index_head_dim + 4
    if keys == "fp4":
        return cfg.index_head_dim // 2 + 4
    raise PlanRefused("admission", f"index key format {keys!r} is unknown: use fp8 or fp4.")


def kv_bytes(cfg: ModelConfig, tokens: int, world: int = 1, options: PlanOptions = PlanOptions()) -> int:
    """Compressed rows + index keys for ``tokens`` positions of one request on one rank (§F)."""
    row, key = kv_row_bytes(cfg, options.kv), index_key_bytes(cfg, options.index_keys)
    total = 0
    for src in cfg.kv_source_layer_ids:
        entries = tokens // cfg.ratio(src)
        rows = entries * row
        total += -(-rows // world) if options.split_kv else rows
        if src in cfg.index_source_layer_ids:
            total += entries * key
    return total


def window_bytes(cfg: ModelConfig, options: PlanOptions = PlanOptions()) -> int:
    """Fixed per request: every layer's slot ring (2·W_n rows) + ratio-2 pending rows (§F)."""
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    pending = sum(2 * cfg.head_dim * 4 for s in cfg.kv_source_layer_ids if cfg.ratio(s) == 2)
    return layers * 2 * cfg.sliding_window * kv_row_bytes(cfg, options.kv) + pending


def cache_pool_bytes(cfg: ModelConfig, world: int, options: PlanOptions, budget: MemoryBudget | None) -> int:
    """The KV pool a rank holds: ``budget.kv_tokens`` (default slots × limit) plus the slots' window rings."""
    tokens = budget.kv_tokens if budget is not None and budget.kv_tokens is not None else None
    if tokens is None:
        tokens = options.slots * context_limit(cfg, options)
    return kv_bytes(cfg, tokens, world, options) + options.slots * window_bytes(cfg, options)


# ------------------------------------------------------------------------------------------------ weights
_DTYPE_BYTES = {"f32": 4.0, "bf16": 2.0, "fp8": 1.0 + 1 / 1024, "fp4": 0.5 + 1 / 32}  # fp8: 32×32 ue8m0 scales;
# fp4: one ue8m0 scale per 32 inputs (MXFP4, 4.25 bits)
_FP8_DENSE = (".attn.wq_a.weight", ".attn.wq_b.weight", ".attn.wkv.weight", ".attn.wo_a.weight",
              ".attn.wo_b.weight", ".indexer.wq_b.weight", ".shared_experts.w1.weight",
              ".shared_experts.w2.weight", ".shared_experts.w3.weight")  # the release's fp8 matrices (§E.2)


def tensor_rank_shape(name: str, shape: tuple[int, ...], adm: Admission, rank: int,
                      padded: bool = True) -> tuple[int, ...]:
    """A model tensor's per-rank shape under MODEL.md §F.1 (padded: expert/vocab shards at the widest width)."""
    W = adm.world
    width = adm.expert_width_padded if padded else adm.expert_widths[rank]
    vocab = adm.vocab_padded if padded else adm.vocab_rows[rank]
    s = list(shape)
    if name.endswith((".attn.wq_b.weight", ".attn.wo_a.weight", ".attn.attn_sink")):
        s[0] //= W  # heads / whole output groups
    elif name.endswith(".attn.wo_b.weight"):
        s[1] //= W  # row-parallel input columns
    elif name.endswith((".experts.w1.weight", ".experts.w3.weight")):
        s[1] = width  # [E, F, D]
    elif name.endswith(".experts.w2.weight"):
        s[2] = width  # [E, D, F]
    elif name.endswith((".shared_experts.w1.weight", ".shared_experts.w3.weight")):
        s[0] = width
    elif name.endswith(".shared_experts.w2.weight"):
        s[1] = width
    elif name in ("embed.weight", "head.weight"):
        s[0] = vocab
    return tuple(s)


def tensor_bytes_per_param(name: str, experts: str, dense: str) -> float:
    """Bytes a parameter of ``name`` takes: f32 roles stay f32 (MODEL.md §B.1); experts and the release's
    fp8 matrices take their chosen format; everything else the 16-bit/f32 model dtype."""
    from dsv41_jax.param_specs import model_dtype_kind

    if model_dtype_kind(name) == "f32":
        return 4.0
    if ".ffn.experts." in name:
        return _DTYPE_BYTES[experts]
    if dense == "fp8":
        return _DTYPE_BYTES["fp8"] if name.endswith(_FP8_DENSE) else 2.0
    return _DTYPE_BYTES[dense]


def param_bytes_per_rank(cfg: ModelConfig, world: int, rank: int, *, experts: str = "bf16",
                         dense: str = "bf16", padded: bool = True, block: int = 128, uneven: bool = True,
                         split: str = "all") -> int:
    """Per-rank weight bytes of the text model (`param_specs.model_tensors`) under MODEL.md §F.1.

    ``experts`` ∈ f32 | bf16 | fp8 | fp4; ``dense`` ∈ f32 | bf16 | fp8 (fp8 applies to the release's fp8
    matrices; embed, head, norms stay 16-bit). ``padded=True`` counts the padding of uneven expert and vocab
    shards (what JAX allocates: every shard is the widest rank's width). ``split``: "all", "experts" (routed
    experts only) or "dense" (the rest).
    """
    for what, value, allowed in (("experts", experts, ("f32", "bf16", "fp8", "fp4")),
                                 ("dense", dense, ("f32", "bf16", "fp8"))):
        if value not in allowed:
            raise PlanRefused("admission", f"{what} format {value!r} is unknown: use one of {', '.join(allowed)}.")
    return _param_bytes(cfg, world, rank, experts, dense, padded, block, uneven, split)


@functools.lru_cache(maxsize=8)
def _model_tensors(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    from dsv41_jax.param_specs import model_tensors  # stdlib-only module; imported late to keep this one light

    return tuple(model_tensors(cfg, engram=False).items())  # engram: `engram_bytes_per_rank`


@functools.lru_cache(maxsize=256)
def _param_bytes(cfg: ModelConfig, world: int, rank: int, experts: str, dense: str, padded: bool, block: int,
                 uneven: bool, split: str) -> int:
    adm = admit(cfg, world, block=block, uneven=uneven)
    total = 0.0
    for name, shape in _model_tensors(cfg):
        is_expert = ".ffn.experts." in name
        if (split == "experts" and not is_expert) or (split == "dense" and is_expert):
            continue
        count = math.prod(tensor_rank_shape(name, shape, adm, rank, padded))
        total += count * tensor_bytes_per_param(name, experts, dense)
    return int(round(total))


def engram_bytes_per_rank(cfg: ModelConfig, world: int, *, tables: str = "host", dense: str = "bf16",
                          rows: int = CAP_2K) -> dict:
    """Engram bytes a rank holds (MODEL.md §B.12, §E.2; PLANNER.md §C, §F):

    * ``tables`` — ``tables="device"``: the rank's slab of every layer's table, split by hash column (24/W
      columns a rank, `engram.column_splits`; padded to the largest slab, as JAX allocates it), e4m3 rows + one
      ue8m0 byte per 32 dims: 25.3 GB a layer at W = 4 in the release. ``"host"``: 0 (``host_tables`` holds
      the whole tables' bytes, memory-mapped on the host, not resident on any device).
    * ``gathered`` — the call's rows as stored, ``rows × 24 × 264 B``: with host tables the input buffer for
      every layer (25.9 MB at 2,048 rows in the release), with device tables one layer's all-gathered rows.
    * ``projection`` — ``wkv`` in ``dense`` (fp8 or the 16-bit model dtype; f32: 4 bytes) plus the f32
      ``q_weight`` / ``k_weight``, replicated.
    """
    from dsv41_jax.engram import column_splits
    from dsv41_jax.param_specs import STORED_BYTES, engram_tensors

    if tables not in ("host", "device"):
        raise PlanRefused("admission", f"engram tables {tables!r}: use host or device.")
    if not cfg.engram_layer_ids:
        return {"tables": 0, "host_tables": 0, "gathered": 0, "projection": 0, "columns": 0}
    d = cfg.engram_head_dim
    row_bytes = d + d // 32  # e4m3 codes + ue8m0 scale bytes
    splits = column_splits(cfg, world)
    slabs = sum(split.slab for split in splits) * row_bytes
    whole = sum(cfg.engram_num_embeddings) * row_bytes
    cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    layers = len(cfg.engram_layer_ids) if tables == "host" else 1
    projection = 0
    for layer in cfg.engram_layer_ids:
        for spec in engram_tensors(cfg, layer):
            n = math.prod(spec.shape)
            if spec.name.endswith(".embed.weight"):
                continue
            if spec.stored == "f32":
                projection += 4 * n
            else:
                projection += n * (_DTYPE_BYTES[dense] if dense in _DTYPE_BYTES else STORED_BYTES["bf16"])
    return {"tables": slabs if tables == "device" else 0, "host_tables": whole if tables == "host" else 0,
            "gathered": rows * layers * cols * row_bytes, "projection": int(projection),
            "columns": max(split.max_columns for split in splits)}


def engram_placement(cfg: ModelConfig, world: int, options: PlanOptions = PlanOptions(),
                     budget: MemoryBudget = MemoryBudget()) -> str:
    """``--engram-tables auto``: "device" when R10 holds at ``world`` with the tables on the devices (split by
    hash column), else "host" (also for a world refused for other reasons: that refusal comes elsewhere)."""
    if not cfg.engram_layer_ids:
        return "device"
    try:
        check_memory(cfg, world, replace(options, engram_tables="device"), budget)
    except PlanRefused:
        return "host"
    return "device"


def _weight_bytes(cfg: ModelConfig, world: int, rank: int, options: PlanOptions) -> int:
    return param_bytes_per_rank(cfg, world, rank, experts=options.experts, dense=options.dense,
                                padded=options.padded, block=options.block, uneven=options.uneven)


# ============================================================================================== vision
# The tower's static shapes and memory (VISION.md §V.G). Images are padded to a few patch buckets (powers of
# two from 64, and the largest image's count rounded up to 512: release 64 … 8,192, 9,216) and token buckets
# (powers of two from 16 up to T_max), so a handful of tower programs serve every image size.
MIN_PATCH_BUCKET, MIN_TOKEN_BUCKET, PATCH_BUCKET_ROUND = 64, 16, 512
VISION_QUERY_CHUNK = 1024  # XLA attention's query chunk: [B, H, 1024, N] f32 scores (VISION.md §V.G)


def max_patches(vc) -> int:
    """The largest n of any image (VISION.md §V.B.7: n ≤ r²·m ≤ r²·(T_max − 3))."""
    return vc.downsample_ratio**2 * (vc.max_image_tokens - 3)


def patch_buckets(vc) -> tuple[int, ...]:
    cap = -(-max_patches(vc) // PATCH_BUCKET_ROUND) * PATCH_BUCKET_ROUND
    return tuple(b for b in (MIN_PATCH_BUCKET << i for i in range(cap.bit_length())) if b < cap) + (cap,)


def token_buckets(vc) -> tuple[int, ...]:
    cap = vc.max_image_tokens
    return tuple(b for b in (MIN_TOKEN_BUCKET << i for i in range(cap.bit_length())) if b < cap) + (cap,)


def _bucket(n: int, buckets: tuple[int, ...], what: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise PlanRefused("admission", f"an image of {n:,} {what} exceeds the largest bucket ({buckets[-1]:,})")


def patch_bucket(n: int, vc) -> int:
    """The padded patch count serving an image of ``n`` patches (the smallest bucket ≥ n)."""
    return _bucket(n, patch_buckets(vc), "patches")


def token_bucket(m: int, vc) -> int:
    """The padded aligner row count serving ``m`` image tokens."""
    return _bucket(m, token_buckets(vc), "image tokens")


def _vision_rank_widths(cfg: ModelConfig, world: int, rank: int, padded: bool) -> tuple[int, int, int]:
    """(heads, MLP columns, aligner columns) rank ``rank`` holds (sharding/rules.py: heads and MLP columns
    ⌈x / W⌉ a rank in order, zero-padded; aligner D / W). ``padded``: the widest rank's, as JAX allocates."""
    vc = cfg.vision

    def share(total: int) -> int:
        each = -(-total // world)
        return each if padded else min(each, max(total - rank * each, 0))

    return share(vc.num_attention_heads), share(vc.intermediate_size), cfg.hidden_size // world


def vision_tensor_rank_shape(name: str, shape: tuple[int, ...], cfg: ModelConfig, world: int, rank: int,
                             padded: bool = True) -> tuple[int, ...]:
    """An image-path tensor's per-rank shape (`param_specs.vision_tensors`; the split of sharding/rules.py)."""
    heads, mlp, aligner = _vision_rank_widths(cfg, world, rank, padded)
    d, s = cfg.vision.head_dim, list(shape)
    if name.endswith(("attn.wqkv.weight", "attn.wqkv.bias")):
        s[0] = 3 * heads * d
    elif name.endswith("attn.wo.weight"):
        s[1] = heads * d
    elif name.endswith("mlp.w1.weight"):
        s[0] = 2 * mlp
    elif name.endswith("mlp.w2.weight"):
        s[1] = mlp
    elif name in ("aligner.w1.weight", "aligner.w1.bias"):
        s[0] = aligner
    elif name == "aligner.w2.weight":
        s[1] = aligner
    return tuple(s)


def vision_param_bytes_per_rank(cfg: ModelConfig, world: int, rank: int, *, dense: str = "bf16",
                                padded: bool = True, blocks_only: bool = False) -> int:
    """Per-rank bytes of the image path's weights (`param_specs.vision_tensors`: tower, aligner, delimiters,
    the routers' f32 ``bias_vl``); 16-bit unless ``dense`` is f32 (fp8 does not apply: the release stores them
    bf16). ``blocks_only``: the ViT blocks alone (what the tower's scan stacks)."""
    from dsv41_jax.param_specs import vision_tensors

    total = 0
    for spec in vision_tensors(cfg):
        if blocks_only and not spec.name.startswith("vision.blocks."):
            continue
        size = 4 if spec.stored == "f32" or dense == "f32" else 2
        total += size * math.prod(vision_tensor_rank_shape(spec.name, spec.shape, cfg, world, rank, padded))
    return total


def vision_workspace(cfg: ModelConfig, world: int, rank: int, options: PlanOptions) -> tuple[tuple[str, int], ...]:
    """The tower's activations for ``options.vision_images`` images at the largest bucket on ``rank`` (bytes,
    an upper bound: the live tensors of one block added up, the XLA attention's chunked scores included, which
    cuDNN's fused attention does not need). Roles: ``v.input`` (patches, RoPE coordinates, the aligner's
    gather), ``v.stream`` (the scan's carry in and out, a row-parallel f32 partial sum), ``v.rope``, ``v.qkv``,
    ``v.attention``, ``v.mlp``, ``v.stacked`` (the scan's copy of the rank's block weights), ``v.aligner``,
    ``v.rows`` (the encoded rows, resident while the request prefills)."""
    vc = cfg.vision
    b, n, m = options.vision_images, patch_buckets(vc)[-1], token_buckets(vc)[-1]
    s = 4 if options.dense == "f32" else 2
    heads, mlp, aligner = _vision_rank_widths(cfg, world, rank, True)
    c, d, r2, dd = vc.hidden_size, vc.head_dim, vc.downsample_ratio**2, cfg.hidden_size
    chunk = VISION_QUERY_CHUNK if n > VISION_QUERY_CHUNK and n % VISION_QUERY_CHUNK == 0 else n
    return (
        ("v.input", b * n * (vc.patch_dim * 2 + 2 * 4 + 1) + b * m * r2 * (4 + 1)),
        ("v.stream", b * n * c * (2 * s + 4)),
        ("v.rope", 2 * b * n * (d // 2) * 4),
        ("v.qkv", b * n * 3 * heads * d * (4 + 2 * s)),
        # Two chunks' scores live at once: XLA:GPU overlaps consecutive chunks (H200, 2026-12-01: tiny tower
        # 37.3 MB of temporaries against 24.2 MB planned with one chunk; CPU stays under one chunk's count).
        ("v.attention", 2 * b * heads * chunk * n * (4 + s) + b * n * heads * d * s),
        ("v.mlp", b * n * mlp * (2 * (4 + s) + s)),
        ("v.stacked", vision_param_bytes_per_rank(cfg, world, rank, dense=options.dense, blocks_only=True)),
        ("v.aligner", b * m * (2 * r2 * c * s + aligner * (4 + s) + dd * (4 + s))),
        ("v.rows", b * m * dd * s),
    )


@dataclass(frozen=True)
class VisionPlan:
    """The tower on one rank: buckets, per-rank widths, weight and workspace bytes (VISION.md §V.G)."""

    patch_buckets: tuple[int, ...]
    token_buckets: tuple[int, ...]
    images: int  # images a tower call encodes (each planned at the largest bucket)
    heads_per_rank: int  # padded
    mlp_per_rank: int  # padded
    weight_bytes: int
    workspace: tuple[tuple[str, int], ...]

    @property
    def workspace_total(self) -> int:
        return sum(b for _, b in self.workspace)

    def to_json(self) -> dict:
        return {"patch_buckets": list(self.patch_buckets), "token_buckets": list(self.token_buckets),
                "images": self.images, "heads_per_rank": self.heads_per_rank, "mlp_per_rank": self.mlp_per_rank,
                "weight_bytes": self.weight_bytes, "workspace_bytes": dict(self.workspace),
                "workspace_total": self.workspace_total}


def plan_vision(cfg: ModelConfig, world: int, rank: int, options: PlanOptions = PlanOptions()) -> VisionPlan:
    """The vision tower's plan on ``rank``; PlanRefused when the config has no vision tower."""
    if cfg.vision is None:
        raise PlanRefused("admission", "this config has no vision_config: there is no vision tower to plan.")
    if cfg.hidden_size % world:
        raise PlanRefused("admission", f"world {world} does not divide the aligner width {cfg.hidden_size}.")
    heads, mlp, _ = _vision_rank_widths(cfg, world, rank, True)
    return VisionPlan(patch_buckets(cfg.vision), token_buckets(cfg.vision), options.vision_images, heads, mlp,
                      vision_param_bytes_per_rank(cfg, world, rank, dense=options.dense, padded=options.padded),
                      vision_workspace(cfg, world, rank, options))


def _vision_terms(cfg: ModelConfig, world: int, rank: int, options: PlanOptions) -> dict[str, int]:
    """R10's vision terms: the tower's weights and workspace when image prompts are planned."""
    if not (options.images and cfg.vision is not None):
        return {"vision_weights": 0, "vision_workspace": 0}
    vp = plan_vision(cfg, world, rank, options)
    return {"vision_weights": vp.weight_bytes, "vision_workspace": vp.workspace_total}


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
            plan = plan_segment(cfg, world, rank, n, start, opts)
            programs.append((part, n, start))
            for role, b in plan.workspace:
                best[role] = max(best.get(role, 0), b)
    return tuple(best.items()), tuple(programs)


# ---------------------------------------------------------------------------------------------- R10 / R6
def _memory_terms(cfg: ModelConfig, adm: Admission, rank: int, options: PlanOptions,
                  budget: MemoryBudget) -> dict[str, int]:
    return {
        "experts": param_bytes_per_rank(cfg, adm.world, rank, experts=options.experts, dense=options.dense,
                                        padded=options.padded, block=options.block, uneven=options.uneven,
                                        split="experts"),
        "dense": param_bytes_per_rank(cfg, adm.world, rank, experts=options.experts, dense=options.dense,
                                      padded=options.padded, block=options.block, uneven=options.uneven,
                                      split="dense"),
        "workspace": buffer_plan(cfg, adm.world, rank, options).total,
        "engram": _engram_device_bytes(cfg, adm.world, options),
        **_vision_terms(cfg, adm.world, rank, options),
        "kv": cache_pool_bytes(cfg, adm.world, options, budget),
        "reserve": budget.reserve_bytes,
    }


def _engram_device_bytes(cfg: ModelConfig, world: int, options: PlanOptions) -> int:
    need = engram_bytes_per_rank(cfg, world, tables=options.engram_tables, dense=options.dense,
                                 rows=prefill_rows(options))
    return need["tables"] + need["gathered"] + need["projection"]


def memory_need(cfg: ModelConfig, world: int, rank: int, options: PlanOptions, budget: MemoryBudget) -> dict:
    """R10's terms on ``rank`` (bytes): experts, dense, workspace (resident buffer plan), engram (projection,
    and the tables when ``options.engram_tables == "device"``), vision_weights and vision_workspace (with
    ``options.images`` and a vision tower: `plan_vision`; else 0), kv, reserve."""
    adm = admit(cfg, world, block=options.block, uneven=options.uneven)
    return _memory_terms(cfg, adm, rank, options, budget)


def _binding_rank(cfg: ModelConfig, adm: Admission, options: PlanOptions, budget: MemoryBudget):
    needs = [_memory_terms(cfg, adm, r, options, budget) for r in range(adm.world)]
    totals = [sum(t.values()) for t in needs]
    # Ties (padded shards are all the widest width) go to the widest real rank.
    rank = max(range(adm.world), key=lambda r: (totals[r], adm.expert_widths[r], -r))
    return rank, needs[rank], totals[rank]


def check_memory(cfg: ModelConfig, world: int, options: PlanOptions, budget: MemoryBudget) -> None:
    """R10 on the widest rank: weights + buffer plan + KV pool + reserve ≤ usable (§F); raises PlanRefused."""
    adm = admit(cfg, world, block=options.block, uneven=options.uneven)
    rank, terms, total = _binding_rank(cfg, adm, options, budget)
    if total <= budget.usable_bytes:
        return
    g = lambda b: f"{b / GiB:,.1f} GiB"  # noqa: E731
    width = adm.expert_widths[rank]
    tokens = budget.kv_tokens if budget.kv_tokens is not None else options.slots * context_limit(cfg, options)
    raise PlanRefused("R10", f"world {world} refused on rank {rank}: {options.experts} experts need "
                      f"{g(terms['experts'])} ({width:,} of {cfg.moe_intermediate_size:,} columns) + "
                      f"{g(terms['dense'])} dense + {g(terms['engram'])} engram ({options.engram_tables} tables) + "
                      f"{g(terms['vision_weights'] + terms['vision_workspace'])} vision tower + "
                      f"{g(terms['workspace'] + terms['reserve'])} workspace and reserve + {g(terms['kv'])} KV "
                      f"({tokens:,} tokens) = {g(total)}, over the "
                      f"{g(budget.usable_bytes)} usable. {_memory_way_out(cfg, world, options, budget)}")


def _fits(cfg: ModelConfig, world: int, options: PlanOptions, budget: MemoryBudget) -> int | None:
    """Total bytes on the binding rank when it fits, else None."""
    try:
        adm = admit(cfg, world, block=options.block, uneven=options.uneven)
    except PlanRefused:
        return None
    total = _binding_rank(cfg, adm, options, budget)[2]
    return total if total <= budget.usable_bytes else None


def _memory_way_out(cfg: ModelConfig, world: int, options: PlanOptions, budget: MemoryBudget) -> str:
    ways = []
    order = ("bf16", "fp8", "fp4")
    if options.experts in order:
        for fmt in order[order.index(options.experts) + 1:]:
            if _fits(cfg, world, replace(options, experts=fmt), budget) is not None:
                need = param_bytes_per_rank(cfg, world, 0, experts=fmt, padded=options.padded,
                                            block=options.block, uneven=options.uneven, split="experts")
                ways.append(f"{fmt} experts ({need / GiB:,.1f} GiB)")
                break
    for w in (2, 4, 8, 16):
        if w > world and _fits(cfg, w, options, budget) is not None:
            ways.append(f"world {w}")
            break
    if options.dense != "fp8" and _fits(cfg, world, replace(options, dense="fp8"), budget) is not None:
        ways.append("fp8 dense weights")
    if not ways:
        for w in (2, 4, 8):
            if w > world and _fits(cfg, w, replace(options, experts="fp4", dense="fp8"), budget) is not None:
                return f"Use fp4 experts and fp8 dense weights at world {w}."
    if not ways:
        return "Nothing smaller fits this budget: raise the budget or shorten the KV pool."
    return "Use " + " or ".join(ways) + "."


def _check_memory(cfg: ModelConfig, adm: Admission, options: PlanOptions, budget: MemoryBudget, n: int,
                  start: int) -> None:
    check_memory(cfg, adm.world, options, budget)
    if options.pf4k and n > CAP_2K:
        rank, terms, total = _binding_rank(cfg, adm, options, budget)
        extra = max(buffer_plan(cfg, adm.world, r, options).total_4k for r in range(adm.world))
        free = budget.usable_bytes - total - budget.floor_4k_bytes
        if extra > free:
            raise PlanRefused("R6", f"{_where(adm, rank, n, start)}: the 4K workspace needs {extra / GiB:,.2f} GiB; "
                              f"{max(free, 0) / GiB:,.2f} GiB is free above the floor on rank {rank}. This prompt "
                              f"uses 2,048-row segments (same bits).")


def fits_4k(cfg: ModelConfig, world: int, options: PlanOptions, budget: MemoryBudget | None) -> bool:
    """Whether 4K mode's workspace fits on every rank (R6); without a budget, yes."""
    if not options.pf4k:
        return False
    if budget is None:
        return True
    try:
        plan_segment(cfg, world, 0, CAP_4K, 0, options, budget)
    except PlanRefused as e:
        if e.rule == "R6":
            return False
        raise
    return True


def max_context(cfg: ModelConfig, world: int, budget: MemoryBudget = MemoryBudget(),
                options: PlanOptions = PlanOptions()) -> int:
    """The largest context (tokens, ≤ the model limit) a rank holds for ``options.slots`` requests.

    Raises PlanRefused (R10) when weights, workspace and reserve alone do not fit.
    """
    adm = admit(cfg, world, block=options.block, uneven=options.uneven)
    empty = replace(budget, kv_tokens=0)
    rank, terms, fixed = _binding_rank(cfg, adm, options, empty)
    room = budget.usable_bytes - fixed
    if room < 0:
        check_memory(cfg, world, options, empty)  # raises with the §C message
    per_slot = room // options.slots
    lo, hi = 0, context_limit(cfg, options)
    while lo < hi:  # kv_bytes is monotone in tokens
        mid = (lo + hi + 1) // 2
        if kv_bytes(cfg, mid, world, options) <= per_slot:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---------------------------------------------------------------------------------------------- segments
def segment_sizes(cfg: ModelConfig, world: int, prompt_len: int, position: int = 0,
                  options: PlanOptions = PlanOptions(), budget: MemoryBudget | None = None) -> list[int]:
    """How the engine cuts a prompt: ``prefill_rows`` segments plus a ragged tail (§A).

    In 4K mode without room for the 4K workspace (R6) the prompt falls back to 2,048-row segments.
    """
    if prompt_len < 0:
        raise PlanRefused("R1", f"prompt length {prompt_len} is negative.")
    limit = context_limit(cfg, options)
    if position < 0 or position + prompt_len > limit:
        raise PlanRefused("R2", f"prompt of {prompt_len:,} tokens at position {position:,} passes the context "
                          f"limit {limit:,}. Shorten the prompt to {max(0, limit - position):,} tokens.")
    if options.pf4k:
        _check_4k(options, f"prompt refused (W = {world})")
        if not fits_4k(cfg, world, options, budget):
            options = replace(options, pf4k=False, prefill_rows=None)
    size = prefill_rows(options)
    full, tail = divmod(prompt_len, size)
    return [size] * full + ([tail] if tail else [])
