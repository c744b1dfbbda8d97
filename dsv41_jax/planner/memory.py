"""The memory side (PLANNER.md §F): R10 (weights + buffer plan + KV pool + reserve within the budget) and R6's 4K
workspace check; ``plan_segment``, a segment's shape plan checked against a budget; ``segment_sizes``, how the
engine cuts a prompt (4K segments only where their workspace fits); the largest context a budget holds. The byte
counts are `sizes`'s, the buffer plan `segment`'s."""

from __future__ import annotations

from dataclasses import replace

from dsv41_jax.config import ModelConfig

from .admission import Admission, admit
from .options import CAP_2K, CAP_4K, GiB, MemoryBudget, PlanOptions, PlanRefused, context_limit, prefill_rows
from .rules import check_4k, segment_label
from .segment import SegmentPlan, buffer_plan, plan_shape
from .sizes import cache_pool_bytes, engram_bytes_per_rank, kv_bytes, param_bytes_per_rank
from .vision import vision_terms


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
        **vision_terms(cfg, adm.world, rank, options),
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
    g = lambda b: f"{b / GiB:,.1f} GiB"
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


def _check_4k_workspace(cfg: ModelConfig, adm: Admission, options: PlanOptions, budget: MemoryBudget, n: int,
                        start: int) -> None:
    """R6: a 4K segment's workspace fits above the floor on the binding rank."""
    rank, terms, total = _binding_rank(cfg, adm, options, budget)
    extra = max(buffer_plan(cfg, adm.world, r, options).total_4k for r in range(adm.world))
    free = budget.usable_bytes - total - budget.floor_4k_bytes
    if extra > free:
        raise PlanRefused("R6", f"{segment_label(adm, rank, n, start)}: the 4K workspace needs {extra / GiB:,.2f} GiB; "
                          f"{max(free, 0) / GiB:,.2f} GiB is free above the floor on rank {rank}. This prompt "
                          f"uses 2,048-row segments (same bits).")


# ---------------------------------------------------------------------------------------- planned segments
def plan_segment(cfg: ModelConfig, world: int, rank: int, rows: int, position: int,
                 options: PlanOptions = PlanOptions(), budget: MemoryBudget | None = None) -> SegmentPlan:
    """Plan ``rows`` rows starting at ``position`` on ``rank`` of ``world``, or raise `PlanRefused`: the shape
    rules (`segment.plan_shape`) and, with a ``budget``, the memory rules R10 and R6.

    Rules are applied with every rank's widths (§B.2 step 3): a shape is accepted only if all ranks accept it.
    """
    plan = plan_shape(cfg, world, rank, rows, position, options, budget)
    if budget is not None:
        check_memory(cfg, world, options, budget)
        if options.pf4k and rows > CAP_2K:
            _check_4k_workspace(cfg, admit(cfg, world, block=options.block, uneven=options.uneven), options,
                                budget, rows, position)
    return plan


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
        check_4k(options, f"prompt refused (W = {world})")
        if not fits_4k(cfg, world, options, budget):
            options = replace(options, pf4k=False, prefill_rows=None)
    size = prefill_rows(options)
    full, tail = divmod(prompt_len, size)
    return [size] * full + ([tail] if tail else [])


# ------------------------------------------------------------------------------------------ context limit
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
