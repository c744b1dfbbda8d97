"""The memory side (PLANNER.md §F): bytes of weights, caches, engram tables; the buffer plan (§B.2); R10 and
R6's workspace check; the largest context a budget holds."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from dsv41_jax.config import ModelConfig

from . import segment
from .admission import Admission, admit
from .options import (CAP_2K, CAP_4K, GiB, MemoryBudget, PlanOptions, PlanRefused, context_limit, prefill_rows)
from .rules import _where
from .vision import _vision_terms


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
                         split: str = "all", dspark: bool = False) -> int:
    """Per-rank weight bytes of the text model (`param_specs.model_tensors`) under MODEL.md §F.1; with
    ``dspark`` also the DSpark stages' (``mtp.*``, §B.13: split like a backbone layer, resident while
    speculating).

    ``experts`` ∈ f32 | bf16 | fp8 | fp4; ``dense`` ∈ f32 | bf16 | fp8 (fp8 applies to the release's fp8
    matrices; embed, head, norms stay 16-bit). ``padded=True`` counts the padding of uneven expert and vocab
    shards (what JAX allocates: every shard is the widest rank's width). ``split``: "all", "experts" (routed
    experts only) or "dense" (the rest).
    """
    for what, value, allowed in (("experts", experts, ("f32", "bf16", "fp8", "fp4")),
                                 ("dense", dense, ("f32", "bf16", "fp8"))):
        if value not in allowed:
            raise PlanRefused("admission", f"{what} format {value!r} is unknown: use one of {', '.join(allowed)}.")
    return _param_bytes(cfg, world, rank, experts, dense, padded, block, uneven, split, dspark)


@functools.lru_cache(maxsize=8)
def _model_tensors(cfg: ModelConfig, dspark: bool = False) -> tuple[tuple[str, tuple[int, ...]], ...]:
    from dsv41_jax.param_specs import model_tensors  # stdlib-only module; imported late to keep this one light

    return tuple(model_tensors(cfg, engram=False, dspark=dspark).items())  # engram: `engram_bytes_per_rank`


@functools.lru_cache(maxsize=256)
def _param_bytes(cfg: ModelConfig, world: int, rank: int, experts: str, dense: str, padded: bool, block: int,
                 uneven: bool, split: str, dspark: bool = False) -> int:
    adm = admit(cfg, world, block=block, uneven=uneven)
    total = 0.0
    for name, shape in _model_tensors(cfg, dspark):
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
                                padded=options.padded, block=options.block, uneven=options.uneven,
                                dspark=options.dspark)


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
            plan = segment.plan_segment(cfg, world, rank, n, start, opts)
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
        segment.plan_segment(cfg, world, 0, CAP_4K, 0, options, budget)
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
