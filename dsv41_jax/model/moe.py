"""Router (sqrtsoftplus), clamped-SwiGLU routed experts and the shared expert (`MODEL.md` §B.10)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.fp8_matmul.ops import Fp8Weight, fp8_matmul
from pallas_kernels.moe.ops import ExpertWeights, clamped_swiglu
from sharding.kernels import routed_experts as sharded_experts

from ..config import ModelConfig
from ..planner import KernelTiles
from .dense import Dense, Fp8Linear
from .norms import HIGHEST, linear, linear_f32, random_normal
from .quant import round_gemm_input


class Router(nnx.Module):
    """``gate.weight [E, D]`` (model dtype), ``gate.bias [E]`` f32 (selection only); with ``image_bias``, also
    ``gate.bias_vl [E]`` f32, the selection bias at image positions (VISION.md §V.E.3)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, n_experts: int | None = None,
                 image_bias: bool = False):
        n_experts = n_experts or cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.temp = cfg.gate_temp
        self.normalize = cfg.norm_topk_prob
        self.route_scale = cfg.routed_scaling_factor
        self.weight = nnx.Param(random_normal(rngs, (n_experts, cfg.hidden_size), cfg.hidden_size**-0.5, dtype))
        self.bias = nnx.Param(jnp.zeros((n_experts,), jnp.float32))
        self.bias_vl = nnx.Param(jnp.zeros((n_experts,), jnp.float32)) if image_bias else None

    def __call__(self, x: jnp.ndarray, is_image: jnp.ndarray | None = None) -> tuple[jnp.ndarray, jnp.ndarray]:
        """x [N,D], is_image bool [N] or None (all text) -> (topk_ids [N,k] int32, topk_weights [N,k] f32).

        Image rows select with ``bias_vl`` instead of ``bias``; the weights are the raw scores either way."""
        # λ = f32(u)·f32(W)ᵀ (§B.10). Two bf16 operands go in as they are: their products are exact in f32 and
        # the sum accumulates in f32, so this is the same λ up to summation order, on tensor cores (an f32
        # GEMM at HIGHEST runs without them).
        weight = self.weight[...]
        if jnp.promote_types(x.dtype, weight.dtype) == jnp.float32:
            x, weight = x.astype(jnp.float32), weight.astype(jnp.float32)
        logits = jnp.einsum("nd,ed->ne", x, weight, preferred_element_type=jnp.float32,
                            precision=HIGHEST) / self.temp
        scores = jnp.sqrt(jax.nn.softplus(logits))
        bias = self.bias[...]
        if is_image is not None:
            if self.bias_vl is None:
                raise ValueError("image positions need a router built with image_bias (ModelOptions.vision)")
            bias = jnp.where(is_image[:, None], self.bias_vl[...], bias)
        _, ids = jax.lax.top_k(scores + bias, self.top_k)
        w = jnp.take_along_axis(scores, ids, axis=-1)
        if self.normalize and self.top_k > 1:
            w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
        return ids.astype(jnp.int32), w * self.route_scale


class _Stacked(nnx.Module):
    def __init__(self, shape, std, dtype, rngs):
        self.weight = nnx.Param(random_normal(rngs, shape, std, dtype))


class _Packed(nnx.Module):
    """One stacked projection [E, O, I] in fp4 as stored: ``codes`` uint8 [E, O, I/2], ``scales`` uint8
    [E, O, I/32] (random codes; scales near 2^-log2(2·√I), so values have roughly the dense init's spread)."""

    def __init__(self, shape, rngs):
        *lead, out, inp = shape
        self.codes = nnx.Param(jax.random.randint(rngs.params(), (*lead, out, inp // 2), 0, 256, jnp.int32)
                               .astype(jnp.uint8))
        byte = 127 - round(math.log2(2 * math.sqrt(inp)))
        self.scales = nnx.Param(jnp.full((*lead, out, -(-inp // 32)), byte, jnp.uint8))


class Experts(nnx.Module):
    """Stacked routed experts: ``w1.weight``, ``w3.weight`` [E,F,D], ``w2.weight`` [E,D,F]; with
    ``expert_format="fp4"`` each projection packed as ``wN.codes`` / ``wN.scales`` (docs/DESIGN.md)."""

    def __init__(self, n_experts: int, dim: int, width: int, *, dtype, rngs: nnx.Rngs,
                 expert_format: str = "dequantized"):
        self.is_fp4 = expert_format == "fp4"
        shapes = {"w1": (n_experts, width, dim), "w3": (n_experts, width, dim), "w2": (n_experts, dim, width)}
        for proj, shape in shapes.items():
            module = _Packed(shape, rngs) if self.is_fp4 else _Stacked(shape, shape[-1]**-0.5, dtype, rngs)
            setattr(self, proj, module)

    def op_weights(self) -> ExpertWeights:
        """The XLA implementation's ``ExpertWeights``: the model dtype, or the packed fp4 form it decodes in the
        activations' dtype (under the caller's jit)."""
        if self.is_fp4:
            return self.packed()
        return ExpertWeights(self.w1.weight[...], self.w3.weight[...], self.w2.weight[...])

    def packed(self) -> ExpertWeights:
        """The fp4 form as stored (codes + ue8m0 scale bytes)."""
        return ExpertWeights.from_fp4(self.w1.codes[...], self.w1.scales[...], self.w3.codes[...],
                                      self.w3.scales[...], self.w2.codes[...], self.w2.scales[...])

    def kernel_weights(self) -> ExpertWeights:
        """The kernel's ``ExpertWeights``: bf16 form, or the packed fp4 form the kernel decodes itself."""
        if self.is_fp4:
            return self.packed()
        # the kernel multiplies bf16 operands (ModelOptions): a float32 model's experts are cast
        w = self.op_weights()
        return ExpertWeights(w.w1.astype(jnp.bfloat16), w.w3.astype(jnp.bfloat16), w.w2.astype(jnp.bfloat16))


class SharedExpert(nnx.Module):
    """The always-on expert: same clamped SwiGLU, unweighted. Its projections are in the model dtype, or as stored
    in fp8 (``dense``, `model/dense.py`). ``gemm_inputs`` "fp8": x and the down projection's input (act in the
    model dtype) rounded first (``quant.round_gemm_input``, as mlx-vlm's shared expert)."""

    def __init__(self, dim: int, width: int, limit: float, *, dtype, rngs: nnx.Rngs, dense: Dense = Dense(),
                 gemm_inputs: str = "exact"):
        self.limit = limit
        self.gemm_inputs = gemm_inputs
        self.dtype = jnp.dtype(dtype)
        self.impl = dense.impl
        rule = "layers.0.ffn.shared_experts."
        self.w1 = dense.linear(dim, width, dtype=dtype, rngs=rngs, rule=rule + "w1")
        self.w3 = dense.linear(dim, width, dtype=dtype, rngs=rngs, rule=rule + "w3")
        self.w2 = dense.linear(width, dim, dtype=dtype, rngs=rngs, rule=rule + "w2")

    def __call__(self, x: jnp.ndarray, row=None) -> jnp.ndarray:
        """x [N, D] -> [N, D] in the model dtype (the promoted dtype of x and the weights)."""
        return self.output(x, self.weights(), partial=False, row=row).astype(jnp.promote_types(x.dtype, self.dtype))

    def weights(self) -> dict:
        """``{"w1", "w3", "w2"}``: the weights ``output`` takes (a rank's slices of them under a mesh): arrays, or
        ``Fp8Weight`` codes + scales as stored."""
        return {k: (m.stored() if isinstance(m, Fp8Linear) else m.weight[...])
                for k, m in (("w1", self.w1), ("w3", self.w3), ("w2", self.w2))}

    def output(self, x: jnp.ndarray, weights: dict, *, partial: bool, row=None) -> jnp.ndarray:
        """f32 [N, D] from ``weights`` (``weights()``, or one rank's F slices of them). ``partial=False``: this
        module's output (rounded to the model dtype as ``__call__`` rounds it); ``partial=True``: w2's f32 sum
        over the given columns before any rounding, the partial sum a rank adds to the routed experts' before
        their one all-reduce (``sharding.kernels.routed_experts``). fp8 weights go through the op itself: this
        runs inside the routed experts' shard_map with a rank's slices, or unsharded. ``row``: the layer's row of
        fp8 weights held as their unit's stack [n, ...] (a scanned unit's, ``transformer._split_routed``). In fp8
        mode the down projection's input is rounded in 32-column blocks of the given columns (a rank's slice
        starts at a multiple of 32 when its width is one, `sharding/layout.py`)."""
        x = round_gemm_input(x, self.gemm_inputs)
        h = clamped_swiglu(self._up(x, weights["w1"], row), self._up(x, weights["w3"], row), self.limit)
        h = round_gemm_input(h, self.gemm_inputs)
        w2 = weights["w2"]
        if isinstance(w2, Fp8Weight):
            y, w2_dtype = fp8_matmul(h, w2, out_dtype=jnp.float32, impl=self.impl, **_at(w2, row)), self.dtype
        else:
            y, w2_dtype = linear_f32(h, w2), w2.dtype
        return y if partial else y.astype(jnp.promote_types(h.dtype, w2_dtype)).astype(jnp.float32)

    def _up(self, x: jnp.ndarray, w, row) -> jnp.ndarray:
        """x · wᵀ in the promoted dtype of x and the weight (for fp8: of x and the model dtype)."""
        if isinstance(w, Fp8Weight):
            return fp8_matmul(x, w, out_dtype=jnp.promote_types(x.dtype, self.dtype), impl=self.impl, **_at(w, row))
        return linear(x, w)


def _at(weight: Fp8Weight, row) -> dict:
    """The op's ``row`` argument for ``weight``: its layer's row when it is a stack [n, N, K], else none."""
    return {"row": row} if weight.codes.ndim == 3 else {}


class MoE(nnx.Module):
    """``ffn.{gate, experts, shared_experts}``: out = bf16(Σ routed + shared)."""

    def __init__(self, cfg: ModelConfig, *, dtype, moe_impl: str, rngs: nnx.Rngs,
                 expert_format: str = "dequantized", image_bias: bool = False, tiles: KernelTiles | None = None,
                 dense: Dense = Dense(), gemm_inputs: str = "exact"):
        """``gemm_inputs``: the routed experts' and the shared expert's (the router always sees u unrounded)."""
        self.limit = cfg.swiglu_limit
        self.moe_impl = moe_impl
        self.gemm_inputs = gemm_inputs
        self.block_m = None if tiles is None else tiles.moe_block_m  # the plan's BM (§E); None: the op's
        self.gate = Router(cfg, dtype=dtype, rngs=rngs, image_bias=image_bias)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                               dtype=dtype, rngs=rngs, expert_format=expert_format)
        if cfg.n_shared_experts:
            self.shared_experts = SharedExpert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit,
                                               dtype=dtype, rngs=rngs, dense=dense, gemm_inputs=gemm_inputs)
        else:
            self.shared_experts = None

    def __call__(self, u: jnp.ndarray, is_image: jnp.ndarray | None = None, row=None,
                 valid: jnp.ndarray | None = None) -> jnp.ndarray:
        """u [B,T,D], is_image bool [B,T] or None -> [B,T,D] in u's dtype. ``row``: int32 scalar when the
        routed experts hold a scanned unit's whole stack [L, E, ...] (``transformer._scan_run``): this
        layer's row, read in place by the op. ``valid`` bool [B,T] or None (all): rows outside it (padding, a
        finished or empty slot's row) route to no expert (id -1: no work in either op), so they cost no expert
        reads; their output, which nothing reads, is the shared expert's alone."""
        flat = u.reshape(-1, u.shape[-1])
        ids, w = self.gate(flat, None if is_image is None else is_image.reshape(-1))
        if valid is not None:
            ids = jnp.where(valid.reshape(-1, 1), ids, -1)
        # The sharding wrapper, for either implementation: inside shard_map under a sharded model, each rank's
        # routed and shared-expert partial sums join before the one f32 psum of y [N, D] (§F.4; the
        # partitioner's own split of the XLA implementation all-reduced the pairs' products [N·k, D]); the plain
        # op otherwise.
        shared = None if self.shared_experts is None else (self.shared_experts.output, self.shared_experts.weights())
        if self.moe_impl == "pallas":
            weights, tiles = self.experts.kernel_weights(), {"block_m": self.block_m}
        else:
            weights, tiles = self.experts.op_weights(), {}
        # fp8 GEMM inputs: each op rounds its own (the routed op x and its weighted act, the shared expert x and
        # its act); the router above took u as it is.
        out = sharded_experts(flat, ids, w, weights, swiglu_limit=self.limit, impl=self.moe_impl, row=row,
                              shared=shared, gemm_inputs=self.gemm_inputs, **tiles)
        return out.reshape(u.shape).astype(u.dtype)
