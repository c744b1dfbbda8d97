"""Limits, options, budgets and the refusal type every planner module shares (PLANNER.md §B.1, §F).

``PLANNED_ONLY``: the options this package plans but no engine path runs yet, each with the reason; the CLI
marks them in ``--help`` and in the printed plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv41_jax.config import ModelConfig

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
    dspark: bool = False  # the DSpark stages' weights resident (generate --speculate; MODEL.md §B.13)
    vision_images: int = 1  # with ``images``: images one tower call encodes, each planned at the largest bucket
    row_parallel_rows: int = 0  # world > 1: segments of ≥ this many rows run HC mixes and norms row-parallel (0: off)


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


# What this package plans but no engine path runs: the plan sizes these so the numbers exist when
# the feature does; ``planned_only`` names the ones a plan uses, and the CLI marks them in --help and the report.
PLANNED_ONLY: dict[str, str] = {
    "replay": "CED bounded replay (§A, R8; parts encoder / decoder): the engine prefills every layer of every "
              "segment",
    "tbo": "two-batch overlap (R9): the engine runs a segment as one batch",
    "spans": "multi-span segments (R7): the engine runs one span a call",
    "split_kv": "compressed rows split over ranks (§F): caches are replicated on every rank (sharding/prepare.py)",
    "staging_ring": "the staging ring (R3) of segments longer than the slot ring: the model writes a segment's "
                    "window rows straight into its sliding_window-row window cache",
    "decode_window": "decode windows of slots × (1 + drafts) rows (§B.3a, plan_decode_window): the engine's decode "
                     "step is one row a sequence, without drafts",
    "moe_blocks": "the bounded / halving MoE strategies (R5): the model's MoE runs every pair of a segment in one "
                  "call (the whole-block strategy)",
    "fp8_weights": "fp8-resident routed experts: the loader decodes fp8 experts to the model dtype (fp4 experts "
                   "stay packed; fp8 dense weights stay as stored with the model's dense_format fp8)",
    "fp8_cache": "fp8 compressed rows / fp8-fp4 index keys: the cache holds them in its dtype (bfloat16 by "
                 "default; plan with kv='bf16' for the engine's bytes)",
}


def planned_only(options: PlanOptions, *, staged: bool = False, moe_strategy: str = "whole") -> tuple[str, ...]:
    """The ``PLANNED_ONLY`` keys a plan with ``options`` (and, from its SegmentPlan, ``staged`` and
    ``moe_strategy``) relies on."""
    used = {
        "replay": options.replay or options.part != "whole",
        "tbo": options.tbo,
        "spans": bool(options.spans),
        "split_kv": options.split_kv,
        "staging_ring": staged,
        "moe_blocks": moe_strategy != "whole",
        "fp8_weights": options.experts == "fp8",
        "fp8_cache": options.kv == "fp8",
    }
    return tuple(key for key, on in used.items() if on)
