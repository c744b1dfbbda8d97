"""THE partition-rule table: every parameter and activation → logical axes → the mesh axis ``tp``.

MaxText-style, in two steps (`MODEL.md` §F.1):

1. ``PARAM_RULES`` / ``ACTIVATION_RULES`` give each tensor dimension a *logical* axis name (or ``None``);
2. ``LOGICAL_TO_MESH[layout]`` maps logical names to the mesh axis ``"tp"`` (or to nothing = replicated).

The kernels' ``shard_map`` specs (``kernels.py``) come from this table too: a kernel operand that is a parameter
takes its parameter rule, an activation its activation rule. While a sharded model traces, the layout is the
active Flax logical-axis rules (``axis_rules(layout)`` under ``nnx.logical_axis_rules``, set by
``context.activate``); the ``layout=None`` arguments below read them ("tp" when none are set).

Two layouts: ``"tp"`` splits routed and shared experts on their intermediate width (the layout the checkpoints
are meant to be served with); ``"ep"`` gives each device whole routed experts (expert parallelism).
Parameter names are the model's NNX state paths joined with ``.`` (= official checkpoint names, experts stacked;
``docs/DESIGN.md``). Every parameter name matches exactly one rule (tested).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flax.core.spmd import get_logical_axis_rules
from jax.sharding import PartitionSpec

from dsv41_jax.param_specs import is_stacked
from sharding.mesh import TP

LAYOUTS = ("tp", "ep")


@dataclass(frozen=True)
class Rule:
    """Parameters whose name fully matches ``pattern`` get ``axes`` (one logical name or None per dim)."""

    pattern: str
    axes: tuple[str | None, ...]
    why: str


# Logical axis names.
VOCAB = "vocab"              # embedding / head rows; 128-row blocks, uneven at W = 4, 8 (padded, §F.3)
Q_HEADS = "q_heads"          # wq_b rows, head-major h·d + i: a contiguous block of rows = whole heads
HEADS = "heads"              # one entry per query head (attn_sink, the head axis of q and o)
O_GROUPS = "o_groups"        # wo_a row blocks / wo_b input columns / the group axis: whole groups of heads
EXPERTS = "experts"          # the stacked routed-expert axis E
EXPERT_MLP = "expert_mlp"    # routed-expert intermediate width F (128-blocks, padded when uneven, §F.2)
SHARED_MLP = "shared_mlp"    # shared-expert intermediate width (follows the routed split, §F.1)
EXPERT_MLP_CODES = "expert_mlp_codes"    # fp4 w2 codes: F/2 bytes (two inputs a byte); the F split halved
EXPERT_MLP_SCALES = "expert_mlp_scales"  # fp4 w2 scales: F/32 bytes (one per 32 inputs); the F split / 32
Q_HEADS_SCALES = "q_heads_scales"  # fp8 wq_b .scale rows: one per 32 rows of wq_b; the head split in 32-row blocks
O_GROUPS_SCALES = "o_groups_scales"  # fp8 wo_a .scale rows / wo_b .scale columns: the group split in 32-blocks
SHARED_MLP_SCALES = "shared_mlp_scales"  # fp8 shared-expert .scale rows (w1/w3) / columns (w2): the F split / 32
ENGRAM_ROWS = "engram_rows"  # engram table rows, split by hash column (whole columns a rank, slabs padded)
ROWS = "rows"                # a row-parallel segment's token axis (the planner's row_parallel_rows; activations only)

VISION_QKV = "vision_qkv"    # attn.wqkv rows: per rank its heads' q, k and v rows (grouped, VisionConfig)
VISION_HEADS = "vision_heads"  # ViT heads: attn.wo input columns (h·d + i), the head axis of q / k / v
VISION_GATE_UP = "vision_gate_up"  # mlp.w1 rows: per rank its columns' gate and up rows (grouped)
VISION_MLP = "vision_mlp"    # ViT MLP width: mlp.w2 input columns, the SiLU·up activations
ALIGNER_HIDDEN = "aligner_hidden"  # aligner.w1 rows (+ bias) = aligner.w2 input columns, the GELU activations
VISION_AXES = (VISION_QKV, VISION_HEADS, VISION_GATE_UP, VISION_MLP, ALIGNER_HIDDEN)  # split in both layouts

# Backbone layers, and stacked units ``layers.3-7.``, ``layers.24_28_32_36.`` (their leading layer axis is never
# split: `param_logical_axes`); DSpark stages are split like a backbone layer (§F.1).
_LAYER = r"(?:layers\.\d+(?:-\d+)?(?:_\d+(?:-\d+)?)*|mtp\.\d+)\."

PARAM_RULES: tuple[Rule, ...] = (
    # ---- split ----
    Rule(r"embed\.weight", (VOCAB, None),
         "vocabulary-parallel: each rank looks up its own rows (others give 0) and the sum is all-reduced (§F.1)"),
    Rule(r"head\.weight", (VOCAB, None),
         "vocabulary-parallel: each rank emits its slice of the logits, gathered at the end (§F.1)"),
    Rule(_LAYER + r"attn\.wq_b\.weight", (Q_HEADS, None),
         "column-parallel by heads: each rank computes q only for its H/P heads (§F.1)"),
    Rule(_LAYER + r"attn\.attn_sink", (HEADS,),
         "one sink logit per head: sliced with the heads it belongs to"),
    Rule(_LAYER + r"attn\.wo_a\.weight", (O_GROUPS, None),
         "block-diagonal: group g reads only its own heads, so whole row blocks follow the heads (§B.6)"),
    Rule(_LAYER + r"attn\.wo_b\.weight", (None, O_GROUPS),
         "row-parallel over the groups' outputs: partial [T, D] sums, all-reduced after wo_b (§F.4)"),
    Rule(_LAYER + r"ffn\.experts\.w[13]\.weight", (EXPERTS, EXPERT_MLP, None),
         "gate/up rows: SwiGLU is elementwise in F, so any split of F is exact after w2's all-reduce (§F.2)"),
    Rule(_LAYER + r"ffn\.experts\.w2\.weight", (EXPERTS, None, EXPERT_MLP),
         "down-projection input columns: same F split as w1/w3; partial sums all-reduced after the MoE"),
    Rule(_LAYER + r"ffn\.experts\.w[13]\.(?:codes|scales)", (EXPERTS, EXPERT_MLP, None),
         "fp4-resident gate/up (packed on D): codes and scales split on their F rows like the float weight"),
    Rule(_LAYER + r"ffn\.experts\.w2\.codes", (EXPERTS, None, EXPERT_MLP_CODES),
         "fp4-resident down codes [E, D, F/2]: the F split halved (128-block splits keep byte pairs whole)"),
    Rule(_LAYER + r"ffn\.experts\.w2\.scales", (EXPERTS, None, EXPERT_MLP_SCALES),
         "fp4-resident down scales [E, D, F/32]: the F split in 32-input groups (whole in 128-block splits)"),
    Rule(_LAYER + r"ffn\.shared_experts\.w[13]\.weight", (SHARED_MLP, None),
         "shared expert split like the routed ones; its partial output joins the routed partial sum (§F.1)"),
    Rule(_LAYER + r"ffn\.shared_experts\.w2\.weight", (None, SHARED_MLP),
         "down-projection input columns of the shared expert"),
    # fp8 dense weights held as stored (ModelOptions.dense_format "fp8"): codes are the ``.weight`` above; each
    # ``.scale`` [⌈out/32⌉, ⌈in/32⌉] is split on the same dimension as its weight, in 32×32 blocks (a world whose
    # shard boundary cuts a block is refused: sharding/layout.py). Replicated weights' scales are below.
    Rule(_LAYER + r"attn\.wq_b\.scale", (Q_HEADS_SCALES, None),
         "fp8 scale rows of wq_b: its head split, one scale row per 32 rows"),
    Rule(_LAYER + r"attn\.wo_a\.scale", (O_GROUPS_SCALES, None),
         "fp8 scale rows of wo_a: its group split, one scale row per 32 rows"),
    Rule(_LAYER + r"attn\.wo_b\.scale", (None, O_GROUPS_SCALES),
         "fp8 scale columns of wo_b: its input-column split, one scale column per 32 columns"),
    Rule(_LAYER + r"ffn\.shared_experts\.w[13]\.scale", (SHARED_MLP_SCALES, None),
         "fp8 scale rows of the shared gate/up: its F split (128-blocks) in 32-row blocks"),
    Rule(_LAYER + r"ffn\.shared_experts\.w2\.scale", (None, SHARED_MLP_SCALES),
         "fp8 scale columns of the shared down-projection: its F split in 32-column blocks"),
    Rule(r"layers\.\d+\.engram\.embed\.(?:weight|scale)", (ENGRAM_ROWS, None),
         "engram tables split by hash column (§B.12; docs/PLANNER.md §C): each rank holds its 24/W columns' rows "
         "(one contiguous range thanks to the per-column offsets, padded to the largest slab), gathers only "
         "those and all-gathers the gathered rows as stored bytes (e4m3 + ue8m0: (256 + 8) B a column and "
         "token, sharding/kernels.engram_gather): 203/W GB a rank instead of 203 GB"),
    # ---- replicated ----
    Rule(r"norm\.weight", (None,),
         "final norm: tiny, and every rank needs the whole normed hidden state for its head slice"),
    Rule(_LAYER + r"hc_(?:attn|ffn)_(?:fn|base|scale)", (None, None),
         "hyper-connection mix: computed redundantly on every rank, it only reads all-reduced streams (§F.4)"),
    Rule(_LAYER + r"(?:attn_norm|ffn_norm)\.weight", (None,),
         "sublayer input norms: the normed input feeds every rank's heads / expert columns"),
    Rule(_LAYER + r"attn\.(?:wq_a|q_norm|wkv|kv_norm)\.weight|" + _LAYER + r"attn\.(?:wq_a|wkv)\.scale",
         (None, None),
         "the q low-rank input and the one shared K=V latent (MQA) are needed by every head: replicated, "
         "so window KV is computed redundantly and no collective is needed (§F.1)"),
    Rule(_LAYER + r"attn\.compressor\.\w+(?:\.weight)?", (None, None),
         "compressed KV entries are shared by all heads: computed redundantly, deterministic on every rank"),
    Rule(_LAYER + r"attn\.indexer\.\w+(?:\.weight|\.scale)?", (None, None),
         "the indexer's top-k is one selection for all heads: computed redundantly (identical on every rank)"),
    Rule(_LAYER + r"ffn\.gate\.(?:weight|bias|bias_vl)", (None, None),
         "router: every rank must pick the same experts, so it routes the same all-reduced input itself"),
    # ---- vision tower and aligner (VISION.md §V.G): split like the text layers. ViT heads and MLP columns a
    # world does not divide are zero-padded per rank (sharding/layout.py, as the text model pads its expert
    # width): a zero head's q = k = v = 0 gives o = 0 and wo's zero columns add nothing; a zero MLP column gives
    # silu(0)·0 = 0. The aligner's D columns split evenly (D = the text hidden size). ----
    Rule(r"mtp\.\d+\.markov_head\.(?:embed|head)\.weight", (VOCAB, None),
         "DSpark Markov head [V, R] (§B.13): vocabulary rows like embed / head, so the bias is a logits slice "
         "per rank and the previous token's row is looked up as the embedding is"),
    Rule(r"mtp\.\d+\.(?:main_proj\.(?:weight|scale)|confidence_head\.proj\.weight)", (None, None),
         "DSpark tap projection [D, 3D] and confidence [1, D + R]: once a round over few rows, replicated"),
    Rule(r"mtp\.\d+\.(?:main_norm|norm)\.weight", (None,),
         "DSpark tap and output norms: every rank needs the whole normed row"),
    Rule(r"vision\.blocks\.\d+\.attn\.wqkv\.weight", (VISION_QKV, None),
         "column-parallel by heads: each rank computes q, k, v of its heads only; its rows are one contiguous "
         "block because the model reads the fused rows grouped rank by rank (VisionConfig.shard_groups)"),
    Rule(r"vision\.blocks\.\d+\.attn\.wqkv\.bias", (VISION_QKV,),
         "the q, k, v bias of a rank's heads, sliced with the rows it belongs to"),
    Rule(r"vision\.blocks\.\d+\.attn\.wo\.weight", (None, VISION_HEADS),
         "row-parallel over the heads' outputs: partial [N, C] sums, all-reduced after wo (as the text wo_b)"),
    Rule(r"vision\.blocks\.\d+\.mlp\.w1\.weight", (VISION_GATE_UP, None),
         "gate and up rows of a rank's MLP columns (grouped like wqkv): SwiGLU is elementwise in the columns"),
    Rule(r"vision\.blocks\.\d+\.mlp\.w2\.weight", (None, VISION_MLP),
         "down-projection input columns, same split as w1: partial sums all-reduced after w2"),
    Rule(r"aligner\.w1\.weight", (ALIGNER_HIDDEN, None),
         "column-parallel over the aligner's D outputs (its largest matrix, 9C × D): GELU is elementwise"),
    Rule(r"aligner\.w1\.bias", (ALIGNER_HIDDEN,), "the bias of a rank's aligner columns"),
    Rule(r"aligner\.w2\.weight", (None, ALIGNER_HIDDEN),
         "row-parallel: partial [M, D] sums all-reduced; the rows then merge into the replicated embeddings"),
    Rule(r"vision\.blocks\.\d+\.attn\.wo\.bias|aligner\.w2\.bias", (None,),
         "added once, after the all-reduce of the row-parallel product: replicated"),
    Rule(r"vision\.(?:patch_embed\.proj\.(?:weight|bias)|norm\.weight|blocks\.\d+\.norm[12]\.weight)",
         (None, None),
         "patch embedding (588 × C, 0.3 % of the tower) and norms: every rank needs the whole residual stream, "
         "which is replicated between blocks (after each all-reduce)"),
    Rule(r"image_(?:start|newline|end)", (None,),
         "image span delimiters [D]: replaced into the replicated input embeddings on every rank"),
    Rule(r"layers\.\d+\.engram\.(?:wkv\.(?:weight|scale)|q_weight|k_weight)", (None, None),
         "engram projection and gate (§B.12): wkv, computed redundantly on every rank on the all-gathered rows; "
         "splitting wkv by input columns would replace the rows' all-gather (6,336 B a token) by an all-reduce "
         "of [T, 25,600] f32 (~100 KB a token), and wkv is small (157 MB fp8 a layer)"),
)
# Axes lists are per dim; a 1-D replicated tensor simply uses the first entry (see ``param_logical_axes``).

LOGICAL_TO_MESH: dict[str, dict[str, str | None]] = {
    "tp": {VOCAB: TP, Q_HEADS: TP, HEADS: TP, O_GROUPS: TP, EXPERTS: None, EXPERT_MLP: TP, SHARED_MLP: TP,
           EXPERT_MLP_CODES: TP, EXPERT_MLP_SCALES: TP, ENGRAM_ROWS: TP, ROWS: TP, **dict.fromkeys(VISION_AXES, TP),
           Q_HEADS_SCALES: TP, O_GROUPS_SCALES: TP, SHARED_MLP_SCALES: TP},
    # Expert parallelism: whole routed experts a rank (E/P each, no padding of F). The shared expert is then
    # replicated: splitting it on F would force F's 128-block padding onto every routed expert too, since
    # both share moe_intermediate_size; it is 1/E of the expert weights.
    "ep": {VOCAB: TP, Q_HEADS: TP, HEADS: TP, O_GROUPS: TP, EXPERTS: TP, EXPERT_MLP: None, SHARED_MLP: None,
           EXPERT_MLP_CODES: None, EXPERT_MLP_SCALES: None, ENGRAM_ROWS: TP, ROWS: TP,
           **dict.fromkeys(VISION_AXES, TP), Q_HEADS_SCALES: TP, O_GROUPS_SCALES: TP, SHARED_MLP_SCALES: None},
}

# Activations: logical axes of the *trailing* dims (leading batch dims are never split; the token dim only in a
# row-parallel segment's streams). Only the ones some code pins (``context.constrain``, the kernels' shard_map
# specs) are listed; the others follow the parameters' splits through XLA's propagation (the parameter rules'
# reasons say where the all-reduces fall).
ACTIVATION_RULES: dict[str, tuple[tuple[str | None, ...], str]] = {
    "logits_shards": ((VOCAB,), "head output [.., V_pad]: each rank its own vocabulary slice"),
    "logits": ((None,), "gathered logits [.., V] handed to the sampler: replicated"),
    "vision_heads": ((VISION_HEADS, None), "ViT q, k, v, o [.., H, d]: each rank its heads; attention is per head"),
    "vision_mlp_hidden": ((VISION_MLP,), "ViT SiLU·up [.., I]: each rank its own MLP columns"),
    "aligner_hidden": ((ALIGNER_HIDDEN,), "aligner GELU output [.., D]: each rank its own columns"),
    "attention_heads": ((HEADS, None), "attention q and o [.., H, Dh]: each rank its own heads "
                        "(sharding/kernels.sparse_attention; the sinks follow their parameter rule)"),
    "engram_local_rows": ((ENGRAM_ROWS, None), "engram row indices [.., W, c_max] in each rank's slab: rank r "
                          "gets its own columns' rows (sharding/kernels.engram_gather)"),
    "engram_gathered": ((None, None), "engram rows [.., C, d + d/32] bytes after the all-gather: replicated"),
    "stream_rows": ((ROWS, None, None), "residual streams [B, T, S, D] of a row-parallel segment: each rank its "
                    "T/P rows for the HC mixes, collapse, norms and expand (replicated per-row work split); "
                    "the sublayer input is gathered ('replicated') before attention and the MoE"),
    "replicated": ((), "caches, tokens, streams, positions, top-k: every rank holds the same values"),
}


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")


def rule_for(name: str) -> Rule:
    """The single rule matching ``name``; KeyError naming the tensor if none does."""
    hits = matching_rules(name)
    if len(hits) != 1:
        raise KeyError(f"tensor {name!r} matches {len(hits)} sharding rules (expected exactly one)")
    return hits[0]


def matching_rules(name: str) -> list[Rule]:
    return [r for r in PARAM_RULES if re.fullmatch(r.pattern, name)]


def param_logical_axes(name: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axis per dim of parameter ``name``; replicated rules fit any rank of tensor. A stacked unit's
    tensor (``layers.A-B.*``, ``layers.A_B.*``; docs/DESIGN.md "Scanned layers") has its layers' axes after an
    unsplit layer axis."""
    axes = rule_for(name).axes
    if is_stacked(name) and not all(a is None for a in axes):
        axes = (None, *axes)
    if all(a is None for a in axes):
        return (None,) * ndim
    if len(axes) != ndim:
        raise ValueError(f"tensor {name!r} has {ndim} dims, its sharding rule expects {len(axes)}")
    return axes


def axis_rules(layout: str) -> tuple[tuple[str, str | None], ...]:
    """``LOGICAL_TO_MESH[layout]`` as Flax logical-axis rules ((logical, mesh axis | None) pairs)."""
    check_layout(layout)
    return tuple(LOGICAL_TO_MESH[layout].items())


def active_layout() -> str:
    """The layout whose rules ``nnx.logical_axis_rules`` holds now ("tp" when no rules are set)."""
    active = dict(get_logical_axis_rules())
    for layout, table in LOGICAL_TO_MESH.items():
        if active == table:
            return layout
    return "tp"


def mesh_axes(axes: tuple[str | None, ...], layout: str | None = None) -> tuple[str | None, ...]:
    layout = active_layout() if layout is None else layout
    check_layout(layout)
    table = LOGICAL_TO_MESH[layout]
    return tuple(table[a] if a is not None else None for a in axes)


def param_spec(name: str, ndim: int, layout: str | None = "tp") -> PartitionSpec:
    """The PartitionSpec of parameter ``name`` (``ndim`` dims) under ``layout``."""
    return PartitionSpec(*mesh_axes(param_logical_axes(name, ndim), layout))


def split_axis(name: str, ndim: int, layout: str = "tp") -> tuple[int, str] | None:
    """(dim, logical axis) of the one dimension of ``name`` split over ``tp``, or None if replicated."""
    hits = [(i, a) for i, (a, m) in enumerate(zip(param_logical_axes(name, ndim),
                                                   mesh_axes(param_logical_axes(name, ndim), layout)))
            if m is not None]
    if len(hits) > 1:
        raise ValueError(f"tensor {name!r} splits more than one dim over tp")
    return hits[0] if hits else None


def activation_spec(activation: str, ndim: int, layout: str | None = None) -> PartitionSpec:
    """PartitionSpec of an activation of ``ndim`` dims (leading dims replicated)."""
    trailing, _ = ACTIVATION_RULES[activation]
    mapped = mesh_axes(trailing, layout)
    return PartitionSpec(*((None,) * (ndim - len(mapped)) + mapped))
