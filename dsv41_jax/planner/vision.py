"""Vision buckets and the tower's plan (VISION.md §V.G): patch / token buckets, per-rank widths, weights and
workspace."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsv41_jax.config import ModelConfig
from dsv41_jax.param_specs import vision_tensors

from .options import PlanOptions, PlanRefused

# The tower's static shapes and memory (VISION.md §V.G). Images are padded to a few patch buckets (powers of
# two from 64, and the largest image's count rounded up to 512: release 64 … 8,192, 9,216) and token buckets
# (powers of two from 16 up to T_max), so a handful of tower programs serve every image size.
MIN_PATCH_BUCKET, MIN_TOKEN_BUCKET, PATCH_BUCKET_ROUND = 64, 16, 512
VISION_QUERY_CHUNK = 1024  # XLA attention's query chunk: [B, H, 1024, N] f32 scores (VISION.md §V.G)
# The scratch XLA:GPU gives a cuBLAS(Lt) GEMM call: 32 MiB on Hopper (4 MiB on older GPUs), a temporary of the
# program live during that call only, so one at a time (the tower's f32 program on the H200 holds an
# s8[33554432] beside its scores). The tower's GEMMs may take this path; none on a CPU.
GEMM_WORKSPACE = 32 << 20


def max_patches(vc) -> int:
    """The largest n of any image (VISION.md §V.B.7: n ≤ r²·m ≤ r²·(T_max − 3))."""
    return vc.downsample_ratio**2 * (vc.max_image_tokens - 3)


def patch_buckets(vc) -> tuple[int, ...]:
    cap = -(-max_patches(vc) // PATCH_BUCKET_ROUND) * PATCH_BUCKET_ROUND
    return tuple(b for b in (MIN_PATCH_BUCKET << i for i in range(cap.bit_length())) if b < cap) + (cap,)


def token_buckets(vc) -> tuple[int, ...]:
    cap = vc.max_image_tokens
    return tuple(b for b in (MIN_TOKEN_BUCKET << i for i in range(cap.bit_length())) if b < cap) + (cap,)


def _bucket(n: int, buckets: tuple[int, ...], what: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise PlanRefused("admission", f"an image of {n:,} {what} exceeds the largest bucket ({buckets[-1]:,})")


def patch_bucket(n: int, vc) -> int:
    """The padded patch count serving an image of ``n`` patches (the smallest bucket ≥ n)."""
    return _bucket(n, patch_buckets(vc), "patches")


def token_bucket(m: int, vc) -> int:
    """The padded aligner row count serving ``m`` image tokens."""
    return _bucket(m, token_buckets(vc), "image tokens")


def _vision_rank_widths(cfg: ModelConfig, world: int, rank: int, padded: bool) -> tuple[int, int, int]:
    """(heads, MLP columns, aligner columns) rank ``rank`` holds (sharding/rules.py: heads and MLP columns
    ⌈x / W⌉ a rank in order, zero-padded; aligner D / W). ``padded``: the widest rank's, as JAX allocates."""
    vc = cfg.vision

    def share(total: int) -> int:
        each = -(-total // world)
        return each if padded else min(each, max(total - rank * each, 0))

    return share(vc.num_attention_heads), share(vc.intermediate_size), cfg.hidden_size // world


def vision_tensor_rank_shape(name: str, shape: tuple[int, ...], cfg: ModelConfig, world: int, rank: int,
                             padded: bool = True) -> tuple[int, ...]:
    """An image-path tensor's per-rank shape (`param_specs.vision_tensors`; the split of sharding/rules.py)."""
    heads, mlp, aligner = _vision_rank_widths(cfg, world, rank, padded)
    d, s = cfg.vision.head_dim, list(shape)
    if name.endswith(("attn.wqkv.weight", "attn.wqkv.bias")):
        s[0] = 3 * heads * d
    elif name.endswith("attn.wo.weight"):
        s[1] = heads * d
    elif name.endswith("mlp.w1.weight"):
        s[0] = 2 * mlp
    elif name.endswith("mlp.w2.weight"):
        s[1] = mlp
    elif name in ("aligner.w1.weight", "aligner.w1.bias"):
        s[0] = aligner
    elif name == "aligner.w2.weight":
        s[1] = aligner
    return tuple(s)


def vision_param_bytes_per_rank(cfg: ModelConfig, world: int, rank: int, *, dense: str = "bf16",
                                padded: bool = True, blocks_only: bool = False) -> int:
    """Per-rank bytes of the image path's weights (`param_specs.vision_tensors`: tower, aligner, delimiters,
    the routers' f32 ``bias_vl``); 16-bit unless ``dense`` is f32 (fp8 does not apply: the release stores them
    bf16). ``blocks_only``: the ViT blocks alone (what the tower's scan stacks)."""
    total = 0
    for spec in vision_tensors(cfg):
        if blocks_only and not spec.name.startswith("vision.blocks."):
            continue
        size = 4 if spec.stored == "f32" or dense == "f32" else 2
        total += size * math.prod(vision_tensor_rank_shape(spec.name, spec.shape, cfg, world, rank, padded))
    return total


def vision_workspace(cfg: ModelConfig, world: int, rank: int, options: PlanOptions) -> tuple[tuple[str, int], ...]:
    """The tower's activations for ``options.vision_images`` images at the largest bucket on ``rank`` (bytes,
    an upper bound: the live tensors of one block added up, the XLA attention's chunked scores included, which
    cuDNN's fused attention does not need). Roles: ``v.input`` (patches, RoPE coordinates, the aligner's
    gather), ``v.stream`` (the scan's carry in and out, a row-parallel f32 partial sum), ``v.rope``, ``v.qkv``,
    ``v.attention``, ``v.mlp``, ``v.gemm`` (a GPU GEMM library call's scratch, ``GEMM_WORKSPACE``), ``v.stacked``
    (the scan's copy of the rank's block weights), ``v.aligner``, ``v.rows`` (the encoded rows, resident while the
    request prefills)."""
    vc = cfg.vision
    b, n, m = options.vision_images, patch_buckets(vc)[-1], token_buckets(vc)[-1]
    s = 4 if options.dense == "f32" else 2
    heads, mlp, aligner = _vision_rank_widths(cfg, world, rank, True)
    c, d, r2, dd = vc.hidden_size, vc.head_dim, vc.downsample_ratio**2, cfg.hidden_size
    chunk = VISION_QUERY_CHUNK if n > VISION_QUERY_CHUNK and n % VISION_QUERY_CHUNK == 0 else n
    return (
        ("v.input", b * n * (vc.patch_dim * 2 + 2 * 4 + 1) + b * m * r2 * (4 + 1)),
        ("v.stream", b * n * c * (2 * s + 4)),
        ("v.rope", 2 * b * n * (d // 2) * 4),
        ("v.qkv", b * n * 3 * heads * d * (4 + 2 * s)),
        # One chunk's f32 scores and probabilities in the model dtype: the chunks run one after another (a loop;
        # a two-chunk tower's program on the H200 holds one chunk's scores).
        ("v.attention", b * heads * chunk * n * (4 + s) + b * n * heads * d * s),
        ("v.mlp", b * n * mlp * (2 * (4 + s) + s)),
        ("v.gemm", GEMM_WORKSPACE),
        ("v.stacked", vision_param_bytes_per_rank(cfg, world, rank, dense=options.dense, blocks_only=True)),
        ("v.aligner", b * m * (2 * r2 * c * s + aligner * (4 + s) + dd * (4 + s))),
        ("v.rows", b * m * dd * s),
    )


@dataclass(frozen=True)
class VisionPlan:
    """The tower on one rank: buckets, per-rank widths, weight and workspace bytes (VISION.md §V.G)."""

    patch_buckets: tuple[int, ...]
    token_buckets: tuple[int, ...]
    images: int  # images a tower call encodes (each planned at the largest bucket)
    heads_per_rank: int  # padded
    mlp_per_rank: int  # padded
    weight_bytes: int
    workspace: tuple[tuple[str, int], ...]

    @property
    def workspace_total(self) -> int:
        return sum(b for _, b in self.workspace)

    def to_json(self) -> dict:
        return {"patch_buckets": list(self.patch_buckets), "token_buckets": list(self.token_buckets),
                "images": self.images, "heads_per_rank": self.heads_per_rank, "mlp_per_rank": self.mlp_per_rank,
                "weight_bytes": self.weight_bytes, "workspace_bytes": dict(self.workspace),
                "workspace_total": self.workspace_total}


def plan_vision(cfg: ModelConfig, world: int, rank: int, options: PlanOptions = PlanOptions()) -> VisionPlan:
    """The vision tower's plan on ``rank``; PlanRefused when the config has no vision tower."""
    if cfg.vision is None:
        raise PlanRefused("admission", "this config has no vision_config: there is no vision tower to plan.")
    if cfg.hidden_size % world:
        raise PlanRefused("admission", f"world {world} does not divide the aligner width {cfg.hidden_size}.")
    heads, mlp, _ = _vision_rank_widths(cfg, world, rank, True)
    return VisionPlan(patch_buckets(cfg.vision), token_buckets(cfg.vision), options.vision_images, heads, mlp,
                      vision_param_bytes_per_rank(cfg, world, rank, dense=options.dense, padded=options.padded),
                      vision_workspace(cfg, world, rank, options))


def vision_terms(cfg: ModelConfig, world: int, rank: int, options: PlanOptions) -> dict[str, int]:
    """R10's vision terms: the tower's weights and workspace when image prompts are planned."""
    if not (options.images and cfg.vision is not None):
        return {"vision_weights": 0, "vision_workspace": 0}
    vp = plan_vision(cfg, world, rank, options)
    return {"vision_weights": vp.weight_bytes, "vision_workspace": vp.workspace_total}
