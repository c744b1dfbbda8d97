"""``python -m dsv41_jax.plan``: print the static plan of one segment (docs/PLANNER.md §B) as a table or JSON.

    python -m dsv41_jax.plan --config dsv41_flash --world 4 --rank 2 --rows 2048 --position 300000
    python -m dsv41_jax.plan --config tiny --world 8 --rows 17 --position 0 --json
    python -m dsv41_jax.plan --config dsv41_flash --world 4 --rows 2048 --position 0 --images --vision-images 2

Weights are planned in the formats the config's ``quantization_config`` says the checkpoint stores (the
release: fp4 routed experts, fp8 dense matrices; bf16 without one); ``--experts`` / ``--dense`` override.
A refusal prints its rule and reason on stderr and exits 2. R10 (memory, docs/PLANNER.md §F) is checked by default
against the H200's 139 GiB usable a device; ``--budget-gib`` sets another budget, ``--no-memory-check`` skips it.
With ``--images`` on a config with a vision tower, the tower's plan is shown too (patch / token buckets, its
per-rank weights and its workspace for ``--vision-images`` images at the largest bucket) and R10 counts both.
A config with engram layers also shows the engram term R10 counts: where the tables are (``--engram-tables``;
auto: device when R10 holds with them split by hash column at this world, else host) and the bytes on the
device (the rank's table slabs, the gathered rows, the projection).

Some options are planned but run by no engine path yet (``planner.PLANNED_ONLY``: replay, two-batch overlap,
multi-span, split KV, staging rings, decode windows, the bounded / halving MoE blocks, fp8-resident weights and
caches); ``--help`` marks their flags and the printed plan lists the ones it relies on, with the reason.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from rich.console import Console
from rich.table import Table

from dsv41_jax.cli import Parser
from dsv41_jax.config import ConfigError, load_named
from dsv41_jax.planner import (
    PLANNED_ONLY,
    WORLDS,
    GiB,
    MemoryBudget,
    PlanOptions,
    PlanRefused,
    SegmentPlan,
    VisionPlan,
    admit,
    buffer_plan,
    engram_bytes_per_rank,
    engram_placement,
    kernel_tiles,
    max_context,
    memory_need,
    plan_segment,
    plan_vision,
    planned_only,
    prefill_rows,
)

EXPERT_FORMATS = ("f32", "bf16", "fp8", "fp4")
DENSE_FORMATS = ("f32", "bf16", "fp8")


def _at_least(lowest: int):
    """An argparse type: an integer ≥ ``lowest``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"{value} must be ≥ {lowest}")
        return value
    return parse


def _positive(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a number > 0")
    return value


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m dsv41_jax.plan", description=__doc__.splitlines()[0],
                epilog="planned only (sized by the planner, run by no engine path yet): "
                       + "; ".join(f"{key}: {why}" for key, why in PLANNED_ONLY.items()))
    p.add_argument("--config", required=True, help="tiny, dsv41_flash, or a config.json / checkpoint directory")
    p.add_argument("--world", type=_at_least(1), required=True,
                   help=f"tensor-parallel world size ({', '.join(map(str, WORLDS))})")
    p.add_argument("--rank", type=_at_least(0), default=0)
    p.add_argument("--rows", type=_at_least(1), required=True, help="rows in the segment")
    p.add_argument("--position", type=_at_least(0), required=True, help="position of the segment's first row")
    p.add_argument("--pf4k", action="store_true", help="4K mode (4,096-row segments; implies the acknowledgement)")
    p.add_argument("--replay", action="store_true",
                   help="CED bounded replay (plans the encoder segment) [planned only: no engine path replays]")
    p.add_argument("--speculate", action="store_true",
                   help="weights include the DSpark stages (mtp.*, resident while generate --speculate runs)")
    p.add_argument("--images", action="store_true",
                   help="plan image prompts: image roles (image_rows = -1) and, with a vision tower, its buckets, "
                        "weights and workspace (counted by R10)")
    p.add_argument("--vision-images", type=_at_least(1), default=1, metavar="N",
                   help="with --images: images one tower call encodes, each planned at the largest bucket "
                        "(default 1)")
    p.add_argument("--experts", "--expert-format", dest="experts", choices=EXPERT_FORMATS, default=None,
                   help="how routed experts are held (default: as the config's quantization_config says the "
                        "checkpoint stores them: fp4 for dsv41_flash, bf16 without a quantization_config) "
                        "[fp8: planned only, the loader decodes fp8 experts]")
    p.add_argument("--dense", choices=DENSE_FORMATS, default=None,
                   help="how the other matrices are held (default: from quantization_config: fp8 for "
                        "dsv41_flash, bf16 without one; the engine holds fp8 as stored with --dense-format fp8 "
                        "and dequantises it to the model dtype with auto / bf16)")
    p.add_argument("--engram-tables", choices=("auto", "device", "host"), default="auto",
                   help="where the engram tables are planned (configs with engram layers): device (split by hash "
                        "column, 24/W columns a rank), host (memory-mapped; only the gathered rows on the "
                        "device), or auto (default): device when it fits the memory budget at this world")
    p.add_argument("--moe", choices=("auto", "bounded", "whole", "halving"), default="auto",
                   help="x3gm block strategy (R5) [bounded, halving: planned only, the model's MoE runs whole "
                        "segments]")
    p.add_argument("--index-budget-mib", type=_at_least(1), default=256, help="B_idx (MiB, ≥ 1)")
    p.add_argument("--indexer", choices=("pallas", "reference"), default="pallas",
                   help="index selection: pallas (default: the fused scores + top-k kernel, path 'fused', its "
                        "workspace) or reference (docs/PLANNER.md §B-3 paths)")
    p.add_argument("--row-parallel-rows", type=_at_least(0), default=0, metavar="N",
                   help="world > 1: segments of >= N rows run the HC mixes and norms row-parallel (kernel tiles "
                        "'row_parallel_rows'; default 0 = off, not yet measured on several GPUs)")
    p.add_argument("--budget-gib", type=_positive, default=None,
                   help="usable memory per device for R10 (default: the H200's 139 GiB, docs/PLANNER.md §F)")
    p.add_argument("--slots", type=_at_least(1), default=1,
                   help="concurrent sequences (window rings, KV pool): the memory rows say how long a context "
                        "each can hold (default 1)")
    p.add_argument("--no-memory-check", action="store_true", help="skip R10")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def stored_formats(cfg) -> tuple[str, str]:
    """(experts, dense): the formats the config's ``quantization_config`` says its checkpoint stores (`docs/MODEL.md`
    §E.1; the release: ``quant_method`` fp8 for dense matrices, ``expert_dtype`` fp4 for routed experts).
    Without a quantization_config both are bf16."""
    quant = cfg.quantization
    if not quant:
        return "bf16", "bf16"
    dense = str(quant.get("quant_method", "bf16")).lower()
    experts = str(quant.get("expert_dtype", dense)).lower()
    if dense not in DENSE_FORMATS or experts not in EXPERT_FORMATS:
        raise ConfigError(f"quantization_config {quant} names formats this planner does not know (dense "
                          f"{dense!r}, experts {experts!r}); pass --dense and --experts")
    return experts, dense


def _options(args: argparse.Namespace, cfg, budget: MemoryBudget | None = None) -> PlanOptions:
    """The plan options; weight formats from the flags, else from the config (``stored_formats``); engram
    tables from ``--engram-tables`` (auto: the planner's choice at this world and budget)."""
    experts, dense = (args.experts, args.dense) if args.experts and args.dense else stored_formats(cfg)
    options = PlanOptions(pf4k=args.pf4k, acknowledge_4k=args.pf4k, replay=args.replay, images=args.images,
                          experts=args.experts or experts, dense=args.dense or dense, moe=args.moe,
                          index_budget=args.index_budget_mib * (1 << 20), indexer_impl=args.indexer,
                          vision_images=args.vision_images, dspark=args.speculate,
                          row_parallel_rows=args.row_parallel_rows, slots=args.slots)
    tables = args.engram_tables
    if tables == "auto":
        tables = engram_placement(cfg, args.world, options, budget or MemoryBudget())
    return PlanOptions(**{**options.__dict__, "engram_tables": tables})


def engram_term(cfg, world: int, options: PlanOptions) -> dict:
    """The engram bytes on a rank (planner.engram_bytes_per_rank) with the placement: what R10 counts."""
    need = engram_bytes_per_rank(cfg, world, tables=options.engram_tables, dense=options.dense,
                                 rows=prefill_rows(options))
    return {"placement": options.engram_tables, **need,
            "device_total": need["tables"] + need["gathered"] + need["projection"]}


def _as_json(cfg, plan: SegmentPlan, options: PlanOptions, vision: VisionPlan | None) -> dict:
    adm = admit(cfg, plan.world, block=options.block, uneven=options.uneven)
    out = plan.to_json()
    out["admission"] = {
        "expert_widths": list(adm.expert_widths), "expert_width_padded": adm.expert_width_padded,
        "expert_columns_padded": list(adm.expert_columns(plan.rank)), "expert_block": adm.expert_split.block,
        "vocab_rows": list(adm.vocab_rows), "vocab_padded": adm.vocab_padded,
        "vocab_rows_padded": list(adm.vocab_slice(plan.rank)), "vocab_block": adm.vocab_split.block,
    }
    out["buffer_plan_bytes"] = buffer_plan(cfg, plan.world, plan.rank, options).bytes
    out["weight_formats"] = {"experts": options.experts, "dense": options.dense}
    if vision is not None:
        out["vision"] = vision.to_json()
        out["total_bytes_with_vision"] = plan.total_bytes + vision.weight_bytes + vision.workspace_total
    if cfg.engram_layer_ids:
        out["engram"] = engram_term(cfg, plan.world, options)
    out["kernel_tiles"] = kernel_tiles(cfg, plan.world, options).__dict__
    out["planned_only"] = {key: PLANNED_ONLY[key] for key in _planned_only(plan, options)}
    return out


def _planned_only(plan: SegmentPlan, options: PlanOptions) -> tuple[str, ...]:
    return planned_only(options, staged=plan.staged, moe_strategy=plan.moe_strategy)


def memory_left(cfg, plan: SegmentPlan, options: PlanOptions, budget: MemoryBudget) -> dict:
    """R10 on the plan's rank without its KV pool (bytes): ``fixed`` (weights, resident workspace, engram and
    vision terms, reserve), ``usable``, ``left`` for the cache (usable − fixed; negative: the weights do not fit),
    and ``max_context``: the longest context each of ``options.slots`` sequences can hold in it (None when nothing
    is left)."""
    need = memory_need(cfg, plan.world, plan.rank, options, budget)
    fixed = sum(v for k, v in need.items() if k != "kv")
    left = budget.usable_bytes - fixed
    try:
        longest = max_context(cfg, plan.world, budget, options) if left > 0 else None
    except PlanRefused:
        longest = None
    return {"fixed": fixed, "usable": budget.usable_bytes, "left": left, "max_context": longest,
            "slots": options.slots}


def _memory_rows(cfg, plan: SegmentPlan, options: PlanOptions, budget: MemoryBudget, b) -> list[tuple[str, str]]:
    m = memory_left(cfg, plan, options, budget)
    longest = ("none: the weights, workspace and reserve do not fit" if m["max_context"] is None else
               f"{m['max_context']:,} tokens for each of {m['slots']} sequence(s) (at most the model's limit)")
    return [("R10: weights, workspace, engram, reserve", f"{b(m['fixed'])} of {b(m['usable'])} usable"),
            ("R10: left for the cache", b(max(m["left"], 0)) if m["left"] >= 0 else f"none ({b(-m['left'])} over)"),
            ("R10: the longest context it holds", longest)]


def _print_table(plan: SegmentPlan, cfg, cfg_name: str, options: PlanOptions, vision: VisionPlan | None,
                 engram_choice: str, budget: MemoryBudget | None = None) -> None:
    def b(n: int) -> str:
        return f"{n:,} B ({n / (1 << 20):,.1f} MiB)" if n < GiB else f"{n:,} B ({n / GiB:,.2f} GiB)"

    t = Table(title=f"{cfg_name}: W = {plan.world}, rank {plan.rank}, n = {plan.rows:,}, start {plan.start:,}",
              show_header=True)
    t.add_column("item")
    t.add_column("value")
    rows = [
        ("part / short / staged", f"{plan.part} / {plan.short} / {plan.staged}"),
        ("ring rows (slot ring)", f"{plan.ring_rows:,} ({plan.slot_ring_rows:,})"),
        ("heads a rank / head tile (BMQ) / grid", f"{plan.heads_per_rank} / {plan.head_tile} / {plan.attention_grid}"),
        ("output groups", str(plan.output_groups)),
        ("expert width (padded) / vocab rows", f"{plan.expert_width:,} ({plan.expert_width_padded:,}) / "
                                               f"{plan.vocab_rows:,}"),
        ("MoE strategy / blocks / block rows (pairs)", f"{plan.moe_strategy} / {plan.moe_blocks} / "
                                                       f"{plan.moe_block_tokens:,} ({plan.moe_block_rows:,})"),
        ("router launches", str(plan.router_launches)),
        ("image rows", "-" if plan.image_rows is None else str(plan.image_rows)),
    ]
    if plan.replay:
        rows.append(("replay: decoder start / tail / stash", f"{plan.replay.decoder_start} / "
                                                             f"{plan.replay.tail_rows} / {plan.replay.stash_rows}"))
    for ip in plan.index_paths:
        rows.append((f"index layer {ip.layer}", f"{ip.kind}, {ip.visible:,} visible, {ip.rows_per_launch:,} rows × "
                                                f"{ip.launches} launches × {ip.splits} splits, {b(ip.scratch_bytes)}"))
    rows += [(f"workspace {role}", b(n)) for role, n in plan.workspace]
    rows += [("workspace total", b(plan.workspace_total)), ("cache", b(plan.cache_bytes)),
             (f"weights ({options.experts} experts, {options.dense} dense"
              f"{', DSpark stages' if options.dspark else ''})", b(plan.weight_bytes)), ("total", b(plan.total_bytes))]
    if vision is not None:
        rows += [("vision patch buckets", ", ".join(f"{n:,}" for n in vision.patch_buckets)),
                 ("vision token buckets", ", ".join(f"{n:,}" for n in vision.token_buckets)),
                 ("vision heads / MLP columns a rank (padded)", f"{vision.heads_per_rank} / {vision.mlp_per_rank:,}"),
                 ("vision weights", b(vision.weight_bytes))]
        rows += [(f"vision workspace {role}", b(n)) for role, n in vision.workspace]
        rows += [(f"vision workspace total ({vision.images} × {vision.patch_buckets[-1]:,} patches)",
                  b(vision.workspace_total)),
                 ("total with the vision tower", b(plan.total_bytes + vision.weight_bytes + vision.workspace_total))]
    if cfg.engram_layer_ids:
        e = engram_term(cfg, plan.world, options)
        where = (f"device, split by hash column ({e['columns']} of "
                 f"{(cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads} columns a layer on this rank)"
                 if e["placement"] == "device" else f"host (memory-mapped, {b(e['host_tables'])})")
        rows += [(f"engram tables ({engram_choice})", where),
                 ("engram on this device (R10 term, not in total)",
                  f"{b(e['device_total'])} = tables {b(e['tables'])} + gathered rows {b(e['gathered'])} + "
                  f"projection {b(e['projection'])}")]
    if budget is not None:
        rows += _memory_rows(cfg, plan, options, budget, b)
    tiles = kernel_tiles(cfg, plan.world, options)
    rows.append(("kernel tiles BMQ / decode / BM", f"{tiles.attention_head_tile} / {tiles.decode_head_tile} / "
                                                  f"{tiles.moe_block_m}"))
    rows.append(("row-parallel per-row work", "this segment" if tiles.row_parallel(plan.rows, plan.world) else
                 f"off (--row-parallel-rows {tiles.row_parallel_rows})" if tiles.row_parallel_rows else "off"))
    for item, value in rows:
        t.add_row(item, value)
    console = Console()
    console.print(t)
    for key in _planned_only(plan, options):
        console.print(f"planned only: {key} — not run by the engine: {PLANNED_ONLY[key]}", highlight=False)


def _budget(args: argparse.Namespace) -> MemoryBudget | None:
    if args.no_memory_check:
        return None
    return MemoryBudget.gib(args.budget_gib) if args.budget_gib is not None else MemoryBudget()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_named(args.config)
        budget = _budget(args)
        options = _options(args, cfg, budget)
        plan = plan_segment(cfg, args.world, args.rank, args.rows, args.position, options, budget)
        vision = plan_vision(cfg, args.world, args.rank, options) if args.images and cfg.vision else None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PlanRefused as e:
        print(f"plan refused ({e.rule}): {e.message}", file=sys.stderr)
        return 2
    if args.json:
        out = _as_json(cfg, plan, options, vision)
        if budget is not None:
            out["memory"] = memory_left(cfg, plan, options, budget)
        print(json.dumps(out, indent=2))
    else:
        choice = "chosen by the planner" if args.engram_tables == "auto" else "--engram-tables"
        _print_table(plan, cfg, args.config, options, vision, choice, budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
