"""The spec's arithmetic for one step: FLOPs per device from `MODEL.md` shapes (2 per multiply-add).

Counted (per row at position p, per layer unless said):

* HC mixes (§B.3, two per layer): the ``[(2+S)S, S·D]`` mix product, collapse ``S·D`` and expand ``S²·D + S·D``
  multiply-adds; Sinkhorn and other elementwise work is left out (≪ 1 %).
* attention projections (§B.6): ``wq_a``, ``wq_b``, ``wkv``, grouped ``wo_a`` (``H·d·R_o``) and ``wo_b``;
* attention over the keys a query really sees: ``min(W, p+1)`` window rows plus, for r > 0,
  ``min(K_I, ⌊(p+1)/r⌋)`` compressed rows; QK and PV are ``2·H·d`` multiply-adds a key;
* compressor (full layers, §B.7): ``wkv`` (and ``wgate`` for r = 2) per row, ``indexer.wk`` per closed entry;
* indexer (index sources, §B.8): ``wq_b``, ``weights_proj`` and the scores ``H_I·(d_I + 1)`` per visible entry;
* MoE (§B.10): router ``D·E``, routed ``k·3·D·F``, shared ``3·D·F``;
* engram (§B.12, engram layers): ``wkv`` ``C·d_e·(S+1)·D`` (C hash columns; the gate's sums are left out);
* head (§B.11): ``D·V`` once per sequence (the engine's steps apply it to each sequence's last row only).

Per device: the parts tensor parallelism splits (``wq_b``, attention heads, ``wo_a``, ``wo_b``, routed and shared
experts, head; `MODEL.md` §F.1) are divided by the world; replicated parts (HC, ``wq_a``, ``wkv`` (attention and
engram), compressor, indexer, router) are counted in full, since every device computes them. Pure Python: no JAX.
"""

from __future__ import annotations

from dsv41_jax.config import ModelConfig


def step_flops(cfg: ModelConfig, rows: int, position: int, world: int = 1, batch: int = 1) -> dict[str, float]:
    """FLOPs per device of one step over ``rows`` rows at positions ``position …`` (decode: rows = 1), by part."""
    parts: dict[str, float] = {}
    for p in range(position, position + rows):
        for part, value in _row_flops(cfg, p, world).items():
            parts[part] = parts.get(part, 0.0) + batch * value
    parts["head"] = batch * 2.0 * cfg.hidden_size * cfg.vocab_size / world
    for part, value in _entry_flops(cfg, rows, position).items():
        parts[part] = parts.get(part, 0.0) + batch * value
    return parts


def _row_flops(cfg: ModelConfig, p: int, world: int) -> dict[str, float]:
    D, H, d, S = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    Rq, Ro, G = cfg.q_lora_rank, cfg.o_lora_rank, cfg.o_groups
    HI, dI, F = cfg.index_n_heads, cfg.index_head_dim, cfg.moe_intermediate_size
    mac = {"hc": 0.0, "attn_proj": 0.0, "attn_core": 0.0, "compressor": 0.0, "indexer": 0.0, "moe": 0.0,
           "engram": 0.0}
    columns = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    mac["engram"] = len(cfg.engram_layer_ids) * columns * cfg.engram_head_dim * (S + 1) * D
    for layer in range(cfg.num_hidden_layers):
        r = cfg.ratio(layer)
        mac["hc"] += 2 * (S * D * cfg.hc_mix_width + S * D + S * S * D + S * D)
        mac["attn_proj"] += D * Rq + D * d + (Rq * H * d + H * d * Ro + G * Ro * D) / world
        keys = min(cfg.sliding_window, p + 1)
        if r > 0:
            visible = (p + 1) // r
            keys += min(cfg.index_topk, visible)
            if cfg.role(layer) == "full":
                mac["compressor"] += D * d * (2 if r == 2 else 1)
            if layer in cfg.index_source_layer_ids:
                mac["indexer"] += Rq * HI * dI + D * HI + HI * (dI + 1) * visible
        mac["attn_core"] += 2 * H * d * keys / world
        experts = cfg.num_experts_per_tok + cfg.n_shared_experts
        mac["moe"] += D * cfg.n_routed_experts + experts * 3 * D * F / world
    return {k: 2.0 * v for k, v in mac.items()}


def _entry_flops(cfg: ModelConfig, rows: int, position: int) -> dict[str, float]:
    """Index keys of the compressed entries this step closes: ``d·d_I`` multiply-adds each."""
    total = 0.0
    for layer in range(cfg.num_hidden_layers):
        r = cfg.ratio(layer)
        if cfg.role(layer) == "full" and layer in cfg.index_source_layer_ids:
            closed = (position + rows) // r - position // r
            total += 2.0 * cfg.head_dim * cfg.index_head_dim * closed
    return {"compressor": total}
