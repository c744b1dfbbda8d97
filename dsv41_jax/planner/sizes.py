"""The bytes a rank holds (PLANNER.md §F): cache rows and pools, weights, engram tables. The leaf the segment plan
and the memory rules both count with; it plans nothing and checks no budget."""

from __future__ import annotations

import functools
import math

from dsv41_jax.config import ModelConfig
from dsv41_jax.param_specs import (
    STORED_BYTES,
    engram_tensors,
    fp8_scale_shape,
    is_fp8_dense,
    model_dtype_kind,
    model_tensors,
)
from pallas_kernels.fp8_matmul.tiling import partial_sums_bytes

from .admission import Admission, admit
from .options import CAP_2K, MemoryBudget, PlanOptions, PlanRefused, context_limit


# ------------------------------------------------------------------------------------------------ caches
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
_DTYPE_BYTES = {"f32": 4.0, "bf16": 2.0, "fp8": 1.0 + 1 / 1024, "fp4": 0.5 + 1 / 32}  # fp8 experts: 32×32 ue8m0
# scales (planned only); fp4: one ue8m0 scale per 32 inputs (MXFP4, 4.25 bits). fp8 dense weights are counted
# exactly: a code byte a parameter plus the rank's ue8m0 bytes (`fp8_dense_bytes`).


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
    fp8 matrices (`param_specs.is_fp8_dense`) take their chosen format (fp8 dense: the code byte; its scale
    bytes are the tensor's, `fp8_dense_bytes`); everything else the 16-bit/f32 model dtype."""
    if model_dtype_kind(name) == "f32":
        return 4.0
    if ".ffn.experts." in name:
        return _DTYPE_BYTES[experts]
    if dense == "fp8":
        return 1.0 if is_fp8_dense(name) else 2.0
    return _DTYPE_BYTES[dense]


def fp8_dense_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of an fp8 dense weight of (a rank's) ``shape`` held as stored: one e4m3 code a parameter plus one ue8m0
    byte per 32×32 block (edge blocks partial)."""
    return math.prod(shape) + math.prod(fp8_scale_shape(shape))


def fp8_dense_shapes(cfg: ModelConfig, adm: Admission, rank: int, padded: bool = True,
                     dspark: bool = False) -> tuple[tuple[str, tuple[int, int], int], ...]:
    """(model name, rank's [N, K], groups) of every fp8 dense projection of the text model (with ``dspark`` the
    DSpark stages' too): the calls of the block-scaled fp8 matmul op (``groups``: wo_a's groups on the rank)."""
    out = []
    for name, shape in _model_tensors(cfg, dspark):
        if is_fp8_dense(name):
            groups = cfg.o_groups // adm.world if name.endswith(".attn.wo_a.weight") else 1
            out.append((name, tensor_rank_shape(name, shape, adm, rank, padded), groups))
    return tuple(out)


def fp8_partial_sums_bytes(cfg: ModelConfig, adm: Admission, rank: int, rows: int, padded: bool = True,
                           dspark: bool = False) -> int:
    """The largest K-split workspace of an fp8 dense call of ``rows`` rows on ``rank`` (the Pallas kernel's f32
    partial sums, `pallas_kernels.fp8_matmul.tiling.partial_sums_bytes`; one call at a time)."""
    return max((partial_sums_bytes(rows, n, k, groups)
                for _, (n, k), groups in fp8_dense_shapes(cfg, adm, rank, padded, dspark)), default=0)


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
        rank_shape = tensor_rank_shape(name, shape, adm, rank, padded)
        if dense == "fp8" and is_fp8_dense(name):
            total += fp8_dense_bytes(rank_shape)
        else:
            total += math.prod(rank_shape) * tensor_bytes_per_param(name, experts, dense)
    return int(round(total))


def weight_bytes(cfg: ModelConfig, world: int, rank: int, options: PlanOptions) -> int:
    """The weight bytes a rank holds under ``options`` (its formats, padding, split, DSpark stages)."""
    return param_bytes_per_rank(cfg, world, rank, experts=options.experts, dense=options.dense,
                                padded=options.padded, block=options.block, uneven=options.uneven,
                                dspark=options.dspark)


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
    from dsv41_jax.engram import column_splits  # noqa: PLC0415 - the engram module imports JAX; the planner does not

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
            elif dense == "fp8":
                projection += fp8_dense_bytes(spec.shape)
            else:
                projection += n * (_DTYPE_BYTES[dense] if dense in _DTYPE_BYTES else STORED_BYTES["bf16"])
    return {"tables": slabs if tables == "device" else 0, "host_tables": whole if tables == "host" else 0,
            "gathered": rows * layers * cols * row_bytes, "projection": int(projection),
            "columns": max(split.max_columns for split in splits)}
