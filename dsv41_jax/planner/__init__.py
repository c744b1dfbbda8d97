"""The static planner (PLANNER.md §B): every segment shape planned and sized before anything runs.

Pure Python (no JAX at import or at call): the same inputs give the same plan on every rank. One module a concern,
every name importable from here (``from dsv41_jax.planner import plan_segment``):

* ``options``: limits, ``PlanOptions``, ``MemoryBudget``, ``PlanRefused``; ``PLANNED_ONLY``, what is planned but
  no engine path runs (replay, two-batch overlap, multi-span, split KV, staging rings, decode windows, MoE blocks,
  fp8-resident experts and caches), and ``planned_only(options)``.
* ``admission``: ``admit`` splits heads, output groups, expert width and vocabulary over a tensor-parallel world
  (§C) with ``Split``, and says how each rank's shard sits inside the evenly padded layout JAX shards.
* ``rules``: the rank-independent shape rules (R1, R2, R6–R9); each refusal names the rule, the numbers and the
  way out.
* ``sizes``: the bytes a rank holds (§F): cache rows and pools, weights, engram tables (the leaf both of the next
  two count with).
* ``segment``: ``plan_shape`` plans one segment (rows, starting position) on one rank by the shape rules (MoE
  blocks R5, index paths, workspace) or raises ``PlanRefused``; ``buffer_plan`` (the role-wise maximum over the
  programs the engine can issue, §B.2); ``plan_decode_window``; ``kernel_tiles``, the tiles the engine's kernels
  run with.
* ``memory``: the memory rules on a budget: R10 (``check_memory``), R6; ``plan_segment``, a segment's shape plan
  checked against a budget; ``segment_sizes``, how the engine cuts a prompt; ``max_context``.
* ``vision``: the tower's patch / token buckets and its plan (VISION.md §V.G).
"""

from .admission import Admission, Split, admit, split_blocks
from .memory import check_memory, engram_placement, fits_4k, max_context, memory_need, plan_segment, segment_sizes
from .options import (
                      BMQ_MAX,
                      CAP_2K,
                      CAP_4K,
                      INDEX_BUDGET,
                      KEY_TILE,
                      MIN_BLOCK,
                      MOE_TILE,
                      PLANNED_ONLY,
                      RESCORE_BYTES_PER_KEY,
                      ROPE_EXTRA,
                      ROUTER_ROWS,
                      SHORT_ROWS,
                      STREAM_BUDGET,
                      STREAM_SPLIT_KEYS,
                      TBO_MIN_ROWS,
                      WORLDS,
                      GiB,
                      KiB,
                      MemoryBudget,
                      MiB,
                      PlanOptions,
                      PlanRefused,
                      context_limit,
                      planned_only,
                      prefill_rows,
)
from .rules import decoder_start
from .segment import (
                      DECODE_HEAD_TILE,
                      DECODE_SMALL_ROWS,
                      BufferPlan,
                      DecodePlan,
                      IndexPath,
                      KernelTiles,
                      ReplayPart,
                      SegmentPlan,
                      activation_row_bytes,
                      buffer_plan,
                      index_paths,
                      kernel_tiles,
                      moe_bound_floats,
                      plan_decode_window,
                      plan_shape,
                      ring_rows,
                      stash_row_bytes,
)
from .sizes import (
                      cache_pool_bytes,
                      engram_bytes_per_rank,
                      fp8_dense_bytes,
                      fp8_dense_shapes,
                      fp8_partial_sums_bytes,
                      index_key_bytes,
                      kv_bytes,
                      kv_row_bytes,
                      param_bytes_per_rank,
                      tensor_bytes_per_param,
                      tensor_rank_shape,
                      weight_bytes,
                      window_bytes,
)
from .vision import (
                      MIN_PATCH_BUCKET,
                      MIN_TOKEN_BUCKET,
                      PATCH_BUCKET_ROUND,
                      VISION_QUERY_CHUNK,
                      VisionPlan,
                      max_patches,
                      patch_bucket,
                      patch_buckets,
                      plan_vision,
                      token_bucket,
                      token_buckets,
                      vision_param_bytes_per_rank,
                      vision_tensor_rank_shape,
                      vision_workspace,
)

__all__ = ["BMQ_MAX", "CAP_2K", "CAP_4K", "DECODE_HEAD_TILE", "DECODE_SMALL_ROWS", "INDEX_BUDGET", "KEY_TILE",
           "MIN_BLOCK", "MIN_PATCH_BUCKET", "MIN_TOKEN_BUCKET", "MOE_TILE", "PATCH_BUCKET_ROUND", "PLANNED_ONLY",
           "RESCORE_BYTES_PER_KEY", "ROPE_EXTRA", "ROUTER_ROWS", "SHORT_ROWS", "STREAM_BUDGET", "STREAM_SPLIT_KEYS",
           "TBO_MIN_ROWS", "VISION_QUERY_CHUNK", "WORLDS", "Admission", "BufferPlan", "DecodePlan", "GiB", "IndexPath",
           "KernelTiles", "KiB", "MemoryBudget", "MiB", "PlanOptions", "PlanRefused", "ReplayPart", "SegmentPlan",
           "Split", "VisionPlan", "activation_row_bytes", "admit", "buffer_plan", "cache_pool_bytes", "check_memory",
           "context_limit", "decoder_start", "engram_bytes_per_rank", "engram_placement", "fits_4k", "index_key_bytes",
           "index_paths", "kernel_tiles", "kv_bytes", "kv_row_bytes", "max_context", "max_patches", "memory_need",
           "moe_bound_floats", "param_bytes_per_rank", "patch_bucket", "patch_buckets", "plan_decode_window",
           "plan_segment", "plan_shape", "plan_vision", "planned_only", "prefill_rows", "ring_rows", "segment_sizes",
           "split_blocks", "stash_row_bytes", "tensor_bytes_per_param", "fp8_dense_bytes", "fp8_dense_shapes",
           "fp8_partial_sums_bytes", "tensor_rank_shape", "token_bucket",
           "token_buckets", "vision_param_bytes_per_rank", "vision_tensor_rank_shape", "vision_workspace",
           "weight_bytes", "window_bytes"]
