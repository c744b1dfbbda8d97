"""The shape rules that do not depend on a rank's widths (PLANNER.md §B.3: R1, R2, R6, R7, R8, R9): each refusal
names the rule, the numbers and the way out."""

from __future__ import annotations

from dsv41_jax.config import ModelConfig

from .admission import Admission
from .options import CAP_2K, CAP_4K, SHORT_ROWS, TBO_MIN_ROWS, PlanOptions, PlanRefused, context_limit, prefill_rows


def segment_label(adm: Admission, rank: int, rows: int, start: int) -> str:
    return f"segment refused (W = {adm.world}, rank {rank}, n = {rows:,}, start {start:,})"


def check_shape(cfg: ModelConfig, adm: Admission, rank: int, n: int, start: int,
                 options: PlanOptions) -> None:
    """R1, R2, R6, R7, R8, R9: the checks that do not depend on a rank's widths."""
    where = segment_label(adm, rank, n, start)
    check_4k(options, where)
    _check_rows(cfg, options, n, where)
    check_position(cfg, options, n, start, where)
    if options.replay or options.part != "whole":
        _check_replay(cfg, options, n, where)
    if options.spans:
        _check_spans(options, n, where)
    if options.tbo:
        _check_tbo(options, n, start, where)


def check_4k(options: PlanOptions, where: str) -> None:
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


def check_position(cfg: ModelConfig, options: PlanOptions, n: int, start: int, where: str) -> None:
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
