"""``cut_layers``: a K-layer config of a full-width model that still exercises its layer roles.

Which layers are kept (in priority order, each with the layers it reads — its kv source, index source and
index-key source, `MODEL.md` §B.9 — as long as the whole set fits in K):

1. the first ratio-2 full layer (compressor with a gate, index keys, indexer);
2. the first ratio-1 full layer, preferring the candidate source (level-1 candidate blocks);
3. the first reindex layer (its own indexer, candidate-masked);
4. the first window-only layer;
5. then reuse layers, and finally every other layer in order.

So for the full config K = 1 keeps layer 2, K = 2 keeps layers 2 and 20 (a ratio-2 full layer and the ratio-1
candidate source), K = 3 adds reindex layer 24, K = 4 adds window layer 0. The kept layers keep their order and
are renumbered 0..K−1; kv / index / candidate source ids are remapped. Because every kept compressed layer keeps
its sources and no other source lies between a layer and its source, every kept layer keeps its role. DSpark is
dropped. Engram is dropped unless ``engram=True``: then the config's first engram layer comes first in the
priority order, and every kept engram layer keeps its table (``engram_table_rows`` rows each when given: the
release's 98 GB tables do not fit one device beside the other weights).

``one_rank`` is a different cut: the work one rank of a world-W tensor-parallel run does, as a model of one
device (the ``--rank-of`` option of ``profile``, ``bench_prefill`` and ``bench_decode``).
"""

from __future__ import annotations

from dsv41_jax.config import ConfigError, ModelConfig
from dsv41_jax.planner import admit


def cut_layers(cfg: ModelConfig, k: int, *, engram: bool = False, engram_table_rows: int | None = None,
               routed_experts: int | None = None) -> ModelConfig:
    """``cfg`` cut to ``k`` decoder layers (see the module docstring); validates; ``k`` ≥ the layer count
    returns ``cfg`` with DSpark (and, unless ``engram``, Engram) dropped. ``routed_experts``: that many routed
    experts a layer instead of the config's (fewer let the whole 40-layer model fit one device; a token
    still reads its top-k of them)."""
    if k < 1:
        raise ConfigError(f"--layers must be at least 1, got {k}")
    if routed_experts is not None and routed_experts < cfg.num_experts_per_tok:
        raise ConfigError(f"--experts {routed_experts} is fewer than the {cfg.num_experts_per_tok} a token picks")
    cut = _renumber(cfg, kept_layers(cfg, k, engram=engram), engram, engram_table_rows)
    return cut if routed_experts is None else cut.replace(n_routed_experts=routed_experts)


def one_rank(cfg: ModelConfig, world: int) -> ModelConfig:
    """One rank's share of ``world``'s tensor-parallel work as a one-device config: the dimensions the rule table
    splits cut as the planner's admission cuts them (``sharding/rules.py``, PLANNER.md §C) — H/W query heads,
    G/W output groups, the widest rank's expert width (routed and shared experts, 128-blocks, padded) and its
    vocabulary rows — and everything the table replicates (HC mixes, norms, ``wq_a``/``wkv``, compressor,
    indexer, router) whole. Timing it on one GPU gives a world-W step without its collectives (and without the
    row-parallel split of the per-row work): what W GPUs cannot beat unless those parts shrink. Text only (the
    image path is dropped: its token ids may fall outside one rank's vocabulary rows); engram tables, split by
    hash column, are not modelled (refused)."""
    if cfg.engram_layer_ids:
        raise ConfigError("one rank's share of a world is modelled for the text layers only: drop the engram layers")
    adm = admit(cfg, world)  # PlanRefused when the world cannot split the heads in whole groups
    return cfg.replace(num_attention_heads=adm.heads_per_rank, o_groups=adm.groups_per_rank,
                       moe_intermediate_size=adm.expert_width_padded, vocab_size=adm.vocab_padded, vision=None,
                       image_token_id=None, image_pad_token_id=None)


def kept_layers(cfg: ModelConfig, k: int, *, engram: bool = False) -> list[int]:
    """The original ids of the layers ``cut_layers(cfg, k, engram=...)`` keeps, in order."""
    return list(range(cfg.num_hidden_layers)) if k >= cfg.num_hidden_layers else _pick_layers(cfg, k, engram)


def _sources(cfg: ModelConfig, layer: int) -> set[int]:
    """The layer and every layer it reads, transitively (kv, index and index-key sources, §B.9)."""
    out, todo = set(), [layer]
    while todo:
        lid = todo.pop()
        if lid in out:
            continue
        out.add(lid)
        for src in (cfg.kv_source(lid), cfg.index_source(lid), cfg.index_key_source(lid)):
            if src is not None and src not in out:
                todo.append(src)
    return out


def _priority(cfg: ModelConfig, engram: bool) -> list[int]:
    layers = range(cfg.num_hidden_layers)
    full2 = [i for i in layers if cfg.role(i) == "full" and cfg.ratio(i) == 2]
    full1 = sorted((i for i in layers if cfg.role(i) == "full" and cfg.ratio(i) == 1),
                   key=lambda i: (i != cfg.candidate_source_layer_id, i))
    reindex = [i for i in layers if cfg.role(i) == "reindex"]
    window = [i for i in layers if cfg.role(i) == "window"]
    reuse = [i for i in layers if cfg.role(i) == "reuse"]
    order = (list(cfg.engram_layer_ids[:1]) if engram else []) + full2[:1] + full1[:1] + reindex[:1] + window[:1]
    order += [i for i in reuse if i not in order]
    return order + [i for i in layers if i not in order]


def _pick_layers(cfg: ModelConfig, k: int, engram: bool) -> list[int]:
    kept: set[int] = set()
    for layer in _priority(cfg, engram):
        need = _sources(cfg, layer)
        if len(kept | need) <= k:
            kept |= need
        if len(kept) == k:
            break
    return sorted(kept)


def _renumber(cfg: ModelConfig, kept: list[int], engram: bool, table_rows: int | None) -> ModelConfig:
    new_id = {old: new for new, old in enumerate(kept)}
    cand = cfg.candidate_source_layer_id
    tables = [(new_id[i], table_rows or n) for i, n in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings)
              if engram and i in new_id]
    return cfg.replace(
        num_hidden_layers=len(kept),
        compress_ratios=tuple(cfg.ratio(i) for i in kept),
        kv_source_layer_ids=tuple(new_id[i] for i in cfg.kv_source_layer_ids if i in new_id),
        index_source_layer_ids=tuple(new_id[i] for i in cfg.index_source_layer_ids if i in new_id),
        candidate_source_layer_id=new_id.get(cand, -1),
        engram_layer_ids=tuple(i for i, _ in tables), engram_num_embeddings=tuple(n for _, n in tables),
        num_nextn_predict_layers=0, dspark_target_layer_ids=(),
    )
