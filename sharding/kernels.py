"""``jax.shard_map`` wrappers of the kernel ops: each device runs its own heads / expert columns.

The partitioner cannot split a Pallas call, so under a mesh the kernels run per device inside ``shard_map``:

* ``sparse_attention``: q and sinks split on heads (``rules``: wq_b rows and attn_sink by head); the KV latent,
  window, top-k and positions are replicated (shared by every head); o comes back split on heads. No collective.
* ``routed_experts``: x, top-k ids and weights replicated (every rank routes identically); layout "tp": each
  device's expert weights hold its F columns (padding columns are zero); layout "ep": its whole experts, the
  other ranks' picks passed as id -1 (outside [0, E): no work, no contribution) with weight 0.
  Each device's y is a partial sum; one ``psum`` in f32 (§F.4). The shared expert, when given, is split on the
  same F ("tp"): each rank adds its unrounded partial sum before that psum, so the MoE moves one [N, D] f32
  all-reduce, not two (XLA combined the shared expert's own into a tuple with the routed one: twice the bytes,
  42 MB more a layer at 2,048 rows). Replicated ("ep"), it is added after the psum.
* ``engram_gather``: the engram tables split by hash column (``rules`` "engram_rows"): each rank gathers its own
  columns' rows from its slab and one ``all_gather`` (the stored bytes, e4m3 + ue8m0) gives every rank all rows.
* ``hc_comb``: in a row-parallel segment the HC mix's comb kernel on each device's rows of the
  segment (activation rule "stream_rows"); a Pallas call cannot be partitioned, so XLA would otherwise gather
  every row's logits to each device, run the whole kernel there and slice. No collective.
* ``fp8_matmul``: a dense projection held as stored in fp8 (codes and ``.scale`` split by the weight's rules, the
  scale blocks whole on each rank: ``layout.check_fp8_blocks``). Replicated weight: everything replicated, no
  collective. Output rows split (wq_b, wo_a, the shared gate/up): y split on its last dim like them (wo_a's x split
  with its groups' columns). Input columns split (wo_b, the shared down-projection): x split on its last dim,
  each rank's f32 partial sum, one ``psum``, then the output dtype.
* ``index_topk``: every input and output replicated (``rules``: the indexer's top-k is one selection for
  all heads, computed redundantly); the shard_map only lets each device run the whole kernel. No collective.

All have the ops' signatures (docs/DESIGN.md) plus ``mesh``/``layout`` (default: JAX's context mesh and the
active logical-axis rules, both set by ``context.activate``; with no mesh the op runs unsharded) and ``op``
(default: the ``pallas_kernels`` entry). Every in/out spec comes from the rule table (``rules.py``): operands that
are parameters take their parameter rule (the sinks, the expert weights: one representative layer's name, every
layer matching the same rule), activations their activation rule.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from dsv41_jax.engram import column_splits
from pallas_kernels.fp8_matmul import ops as fp8_ops
from pallas_kernels.hc_mix import ops as hc_mix_ops
from pallas_kernels.indexer import ops as indexer_ops
from pallas_kernels.moe import ops as moe_ops
from pallas_kernels.sparse_attention import ops as attention_ops
from sharding.context import active_mesh
from sharding.mesh import TP
from sharding.rules import (
    EXPERTS,
    SHARED_MLP,
    activation_spec,
    active_layout,
    mesh_axes,
    param_spec,
    split_axis,
)

_ATTENTION = "layers.0.attn."        # any layer: every layer's tensors match the same rules
_EXPERTS = "layers.0.ffn.experts."
_STACKED_UNIT = "layers.0-1."  # any stacked unit's names: its layers' rules after the layer axis
_STACKED_EXPERTS = _STACKED_UNIT + "ffn.experts."
_SHARED = "layers.0.ffn.shared_experts."  # the loop slices a unit's dequantised shared expert a layer: a layer's rule
# The kernel's ExpertWeights fields (pallas_kernels/moe/ops.py) → the parameter each one is a view of.
_EXPERT_FIELDS = {"w1": "w1", "w3": "w3", "w2": "w2", "w1_scale": "w1.scales", "w3_scale": "w3.scales",
                  "w2_scale": "w2.scales"}


def _mesh(mesh: Mesh | AbstractMesh | None) -> Mesh | AbstractMesh | None:
    mesh = active_mesh() if mesh is None else mesh
    return None if mesh is None or mesh.size == 1 else mesh


def _replicated(*arrays) -> tuple:
    """Replicated specs; an absent operand (None: a window-only layer's pool and picks) gets an empty one."""
    return tuple(activation_spec("replicated", 0 if a is None else a.ndim) for a in arrays)


def sparse_attention(q, kv_pool, topk, window, window_start, q_pos, sinks, *, mesh: Mesh | None = None,
                     op: Callable | None = None, **kwargs):
    """o [B,T,H,Dh] = op(...) with q [B,T,H,Dh] and sinks [H] split on heads over ``tp``."""
    op = attention_ops.sparse_attention if op is None else op
    mesh = _mesh(mesh)
    if mesh is None:
        return op(q, kv_pool, topk, window, window_start, q_pos, sinks, **kwargs)
    heads = activation_spec("attention_heads", q.ndim)
    in_specs = (heads, *_replicated(kv_pool, topk, window, window_start, q_pos),
                param_spec(_ATTENTION + "attn_sink", sinks.ndim, None))

    def local(q, kv_pool, topk, window, window_start, q_pos, sinks):
        return op(q, kv_pool, topk, window, window_start, q_pos, sinks, **kwargs)

    run = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)
    return run(q, kv_pool, topk, window, window_start, q_pos, sinks)


def hc_comb(logits, *, mesh: Mesh | None = None, op: Callable | None = None, **kwargs):
    """comb [B,T,S,S] = op(logits [B,T,S,S]) with the token axis split over ``tp`` (a row-parallel segment's
    rows, rule "stream_rows"): each device runs the kernel on its own rows."""
    op = hc_mix_ops.comb if op is None else op
    mesh = _mesh(mesh)
    if mesh is None:
        return op(logits, **kwargs)
    rows = activation_spec("stream_rows", logits.ndim)
    run = jax.shard_map(lambda c: op(c, **kwargs), mesh=mesh, in_specs=rows, out_specs=rows, check_vma=False)
    return run(logits)


def index_topk(q, w, keys, positions, kept_blocks=None, *, mesh: Mesh | None = None, op: Callable | None = None,
               **kwargs):
    """(topk [B,T,K], kept | None) = op(...), every array replicated: each device runs the whole selection."""
    op = indexer_ops.index_topk if op is None else op
    mesh = _mesh(mesh)
    if mesh is None:
        return op(q, w, keys, positions, kept_blocks, **kwargs)
    args = (q, w, keys, positions) + (() if kept_blocks is None else (kept_blocks,))
    run = jax.shard_map(lambda *a: op(*a, **kwargs), mesh=mesh, in_specs=_replicated(*args),
                        out_specs=activation_spec("replicated", 0), check_vma=False)  # P(): a prefix of all outputs
    return run(*args)


def fp8_matmul(x, weight, *, rule: str, groups: int = 1, out_dtype=None, mesh: Mesh | None = None,
               layout: str | None = None, op: Callable | None = None, **kwargs):
    """y [..., N] = op(x [..., G·K], weight) (``pallas_kernels.fp8_matmul.ops.fp8_matmul``'s signature) with the
    weight's codes and scales split by the rules of ``rule + ".weight"`` / ``rule + ".scale"`` (``rule``: the
    model name of the weight, any layer's, without its suffix: ``"layers.0.attn.wo_b"``)."""
    op = fp8_ops.fp8_matmul if op is None else op
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    mesh = _mesh(mesh)
    row = kwargs.pop("row", None)  # a stack of layers [L, N, K] (a scanned unit's) read at this layer's row
    row_kwargs = {} if row is None else {"row": row}
    if mesh is None:
        return op(x, weight, groups=groups, out_dtype=out_dtype, **row_kwargs, **kwargs)
    layout = active_layout() if layout is None else layout
    if row is not None:  # any stacked unit's name: its layers' rule after the unsplit layer axis
        rule = re.sub(r"^layers\.\d+\.", _STACKED_UNIT, rule)
    codes_name, scales_name = rule + ".weight", rule + ".scale"
    weight_specs = fp8_ops.Fp8Weight(param_spec(codes_name, weight.codes.ndim, layout),
                                     param_spec(scales_name, weight.scales.ndim, layout))
    hit = split_axis(codes_name, weight.codes.ndim, layout)
    replicated = activation_spec("replicated", x.ndim)
    if hit is None:
        x_spec, y_spec, local_groups, reduce = replicated, replicated, groups, False
    else:
        axis, logical = hit
        last = PartitionSpec(*(None,) * (x.ndim - 1), *mesh_axes((logical,), layout))  # the weight's split
        if axis == weight.codes.ndim - 2:  # output rows: y split like them; a grouped x with its groups' columns
            x_spec, y_spec, reduce = (last if groups > 1 else replicated), last, False
            local_groups = groups // mesh.size if groups > 1 else 1
        else:  # input columns: x split like them, partial sums reduced
            x_spec, y_spec, local_groups, reduce = last, replicated, groups, True

    def local(x, w, row_kwargs):
        if not reduce:
            return op(x, w, groups=local_groups, out_dtype=out_dtype, **row_kwargs, **kwargs)
        y = op(x, w, groups=local_groups, out_dtype=jnp.float32, **row_kwargs, **kwargs)
        return jax.lax.psum(y, TP).astype(out_dtype)

    row_specs = {k: activation_spec("replicated", 0) for k in row_kwargs}
    run = jax.shard_map(local, mesh=mesh, in_specs=(x_spec, weight_specs, row_specs), out_specs=y_spec,
                        check_vma=False)
    return run(x, weight, row_kwargs)


def routed_experts(x, topk_ids, topk_weights, weights, *, swiglu_limit: float, mesh: Mesh | None = None,
                   layout: str | None = None, op: Callable | None = None, row=None, shared=None,
                   gemm_inputs: str = "exact", **kwargs):
    """y [N,D] f32 = op(...) (+ the shared expert) with the expert weights split by ``layout`` and the partial
    sums all-reduced.

    ``weights``: a pytree of stacked expert arrays, ``ExpertWeights`` or a dict with its field names (w1/w3
    ``[E, F, ·]``, w2 ``[E, D, ·]``; packed fp4 codes and their scales follow the same axes); each leaf takes the
    rule of the expert parameter it is a view of (``_EXPERT_FIELDS``). With ``row`` (the op's: an int32 scalar),
    the experts of a stack of layers ``[L, E, ...]`` (a scanned unit's parameters: their rule after the unsplit
    layer axis) and this call's layer in it; ids stay the layer's own.
    ``shared``: ``(output, shared_weights)``, the shared expert (``model.moe.SharedExpert``: ``output(x, w,
    partial=...)`` f32 [N, D], ``shared_weights`` its ``{"w1", "w3", "w2"}``), added to y: as a rank's partial
    sum before the psum when ``layout`` splits its width, whole otherwise.
    ``gemm_inputs``: the op's (``"fp8"``: each rank rounds x and its weighted act in blocks of 32 of its own F
    columns; the shared expert rounds its own inputs, ``SharedExpert.gemm_inputs``).
    """
    op = moe_ops.routed_experts if op is None else op
    if gemm_inputs != "exact":  # the exact mode calls the op as it always did (a given ``op`` may not know it)
        kwargs["gemm_inputs"] = gemm_inputs
    row_kwargs = {} if row is None else {"row": row}   # a shard_map operand (replicated) when there is a mesh
    mesh = _mesh(mesh)
    if mesh is None:
        y = op(x, topk_ids, topk_weights, weights, swiglu_limit=swiglu_limit, **row_kwargs, **kwargs)
        return y if shared is None else y + shared[0](x, shared[1], partial=False, row=row)
    layout = active_layout() if layout is None else layout
    split_shared = shared is not None and mesh_axes((SHARED_MLP,), layout)[0] is not None
    output, shared_weights = shared if split_shared else (None, {})
    stacked = row is not None
    weight_specs = jax.tree_util.tree_map_with_path(lambda path, a: _expert_spec(path, a, layout, stacked),
                                                    weights)
    whole_experts = mesh_axes((EXPERTS,), layout)[0] is not None
    y_spec = activation_spec("replicated", x.ndim)

    def local(x, ids, w, local_weights, row_kwargs, local_shared):
        if whole_experts:
            experts_here = jax.tree.leaves(local_weights)[0].shape[1 if stacked else 0]
            ids, w = _local_experts(ids, w, experts_here)
        y = op(x, ids, w, local_weights, swiglu_limit=swiglu_limit, **row_kwargs, **kwargs).astype(jnp.float32)
        if output is not None:
            y = y + output(x, local_shared, partial=True, **row_kwargs)
        return jax.lax.psum(y, TP)

    row_specs = {k: activation_spec("replicated", 0) for k in row_kwargs}
    shared_specs = {k: _shared_spec(k, a, layout) for k, a in shared_weights.items()}
    run = jax.shard_map(local, mesh=mesh,
                        in_specs=(*_replicated(x, topk_ids, topk_weights), weight_specs, row_specs, shared_specs),
                        out_specs=y_spec, check_vma=False)
    y = run(x, topk_ids, topk_weights, weights, row_kwargs, shared_weights)
    return y if shared is None or split_shared else y + shared[0](x, shared[1], partial=False, row=row)


def _shared_spec(proj: str, weight, layout: str):
    """The rule-table spec of the shared expert's ``proj`` weight: an array's, or an ``Fp8Weight``'s codes and
    scales (their ``.weight`` and ``.scale`` rules)."""
    name = _SHARED + proj
    if isinstance(weight, fp8_ops.Fp8Weight):
        if weight.codes.ndim == 3:  # a scanned unit's stack, read at the layer's row (model.moe.SharedExpert)
            name = _STACKED_UNIT + "ffn.shared_experts." + proj
        return fp8_ops.Fp8Weight(param_spec(name + ".weight", weight.codes.ndim, layout),
                                 param_spec(name + ".scale", weight.scales.ndim, layout))
    return param_spec(name + ".weight", weight.ndim, layout)


def _expert_spec(path, leaf, layout: str, stacked: bool = False):
    """The rule-table spec of the expert parameter that leaf ``path`` of the kernel's weights is a view of
    (``stacked``: of a stacked unit's parameter, [L, ...])."""
    key = path[-1]
    field = str(getattr(key, "name", getattr(key, "key", key)))
    if field not in _EXPERT_FIELDS:
        raise KeyError(f"expert weight field {field!r} has no parameter rule (known: {', '.join(_EXPERT_FIELDS)})")
    name = _EXPERT_FIELDS[field]
    if "." not in name:
        name += ".codes" if leaf.dtype == jnp.uint8 else ".weight"
    return param_spec((_STACKED_EXPERTS if stacked else _EXPERTS) + name, leaf.ndim, layout)


def _local_experts(ids, w, experts_here: int):
    """Global expert ids → this rank's; other ranks' picks get id -1 (outside [0, E): "contributes nothing"
    in the kernel contract, and no work) and, should an op still look one up, weight 0."""
    local = ids - jax.lax.axis_index(TP) * experts_here
    mine = (local >= 0) & (local < experts_here)
    return jnp.where(mine, local, -1).astype(ids.dtype), jnp.where(mine, w, 0.0).astype(w.dtype)


def engram_gather(weight, scale, rows, *, cfg, layer: int, mesh: Mesh | None = None):
    """(codes [.., C, d] e4m3, scale bytes [.., C, d/32] uint8) of engram layer ``layer``'s table rows
    ``rows [.., C]`` (absolute, `dsv41_jax.engram.Hasher`), replicated.

    Unsharded: two gathers. Sharded: the tables are split by hash column (`rules`: "engram_rows", padded slabs,
    ``cfg`` the padded run config: its primes give the split), so rank r gathers only its columns' rows (their
    indices less its first row, ``[.., W, c_max]`` split on W) and one all-gather of the gathered bytes — codes
    and scale bytes side by side, (d + d/32) a column — gives every rank all C columns; slots past a rank's
    columns (uneven splits) are dropped after it. Why an all-gather of rows and not ``wkv`` split by input
    columns: see the rule's reason.
    """
    mesh = _mesh(mesh)
    if mesh is None:
        return jnp.take(weight, rows, axis=0), jnp.take(scale, rows, axis=0)
    split = column_splits(cfg, mesh.size)[cfg.engram_layer_ids.index(layer)]
    cols, starts, real = _engram_slots(split)
    local = jnp.clip(rows[..., cols] - starts, 0, split.slab - 1).astype(jnp.int32)  # [.., W, c_max]
    table = param_spec(f"layers.{layer}.engram.embed.weight", 2, None)
    d = weight.shape[-1]

    def gather(w, s, idx):  # w [slab, d] e4m3, s [slab, d/32] u8, idx [.., 1, c_max]
        idx = idx[..., 0, :]
        codes = jax.lax.bitcast_convert_type(jnp.take(w, idx, axis=0), jnp.uint8)
        packed = jnp.concatenate([codes, jnp.take(s, idx, axis=0)], axis=-1)  # [.., c_max, d + d/32]
        return jax.lax.all_gather(packed, TP, axis=packed.ndim - 2, tiled=True)

    run = jax.shard_map(gather, mesh=mesh, in_specs=(table, table, activation_spec("engram_local_rows", local.ndim)),
                        out_specs=activation_spec("engram_gathered", local.ndim), check_vma=False)
    packed = run(weight, scale, local)[..., real, :]  # [.., C, d + d/32] in column order
    return jax.lax.bitcast_convert_type(packed[..., :d], jnp.float8_e4m3fn), packed[..., d:]


def _engram_slots(split):
    """For a `dsv41_jax.engram.ColumnSplit`: (column of each rank's slot int32 [W, c_max] (padding slots repeat a
    real column), each rank's first row int32 [W, 1], the real slots' positions in the gathered [W·c_max] order
    int32 [C])."""
    w, c = split.world, split.max_columns
    cols = np.zeros((w, c), np.int32)
    real = []
    for r in range(w):
        n, first = split.columns[r], split.col_start(r)
        cols[r] = np.minimum(first + np.minimum(np.arange(c), max(n - 1, 0)), sum(split.columns) - 1)
        real += [r * c + j for j in range(n)]
    starts = np.array([[split.row_start(r)] for r in range(w)], np.int32)
    return cols, starts, np.array(real, np.int32)
