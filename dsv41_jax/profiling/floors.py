"""What a step cannot beat on the H200: the bytes it must read and the FLOPs it must do.

* ``weight_bytes``: the weights one device reads in a step of N rows: every weight but the routed experts and
  the embedding, the routed experts the rows touch (expected distinct experts per layer under uniform routing,
  E·(1 − (1 − k/E)^N)), and the embedding rows gathered;
* ``cache_bytes``: the cache one decode step reads per device: window rings, the top-k compressed entries, and
  every index key an indexer scores;
* ``step_floor``: max(bytes ÷ bandwidth, FLOPs ÷ GEMM rate) — weight reads and tensor-core work overlap, so
  the larger bounds the step.

The H200 figures are this project's own measurements (docs/BENCHMARKS.md): 4.3 TB/s copy, 668 TFLOP/s bf16 GEMM.
"""

from __future__ import annotations

import math

from flax import nnx

from dsv41_jax.loading import param_name

H200_BYTES_PER_S = 4.3e12
H200_BF16_FLOPS = 668e12


def distinct_experts(experts: int, per_token: int, rows: int) -> float:
    """Expected distinct experts ``rows`` tokens route to, each picking ``per_token`` of ``experts`` uniformly."""
    return experts * (1.0 - (1.0 - per_token / experts) ** rows)


def weight_bytes(model, cfg, rows: int) -> tuple[float, float]:
    """(bytes one device reads of the weights in a step of ``rows`` rows, expected distinct experts per layer)."""
    touched = distinct_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, rows)
    total = 0.0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = param_name(path)
        leaf = var[...]
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        nbytes = math.prod(shape) * leaf.dtype.itemsize
        if ".ffn.experts." in name:  # stacked routed experts [E, ...]: the touched ones
            nbytes *= touched / cfg.n_routed_experts
        elif name.endswith("embed.weight"):  # a gather of the rows' embeddings
            nbytes *= min(1.0, rows / cfg.vocab_size)
        total += nbytes
    return total, touched


def cache_bytes(cfg, batch: int, position: int, itemsize: int = 2) -> float:
    """Bytes of cache one decode step reads per device (caches are replicated): each layer's window ring, the
    top-k compressed entries it attends to, and for each indexer every index key it scores."""
    total = 0
    for layer in range(cfg.num_hidden_layers):
        total += cfg.sliding_window * cfg.head_dim
        ratio = cfg.ratio(layer)
        if ratio > 0:
            total += min(cfg.index_topk, position // ratio) * cfg.head_dim
            if layer in cfg.index_source_layer_ids:
                key_ratio = cfg.ratio(cfg.index_key_source(layer))
                total += (position // key_ratio) * cfg.index_head_dim
    return float(total * itemsize * batch)


def step_floor(nbytes: float, flops: float, *, bandwidth: float = H200_BYTES_PER_S,
               flop_rate: float = H200_BF16_FLOPS) -> dict[str, float]:
    """Seconds: the read floor, the compute floor and the step's floor (their max)."""
    read_s, compute_s = nbytes / bandwidth, flops / flop_rate
    return {"read_s": read_s, "compute_s": compute_s, "floor_s": max(read_s, compute_s)}
