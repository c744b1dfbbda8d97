"""The tensor inventory of the V4.1 text model: official checkpoint names and the model's names.

One place lists every tensor (`MODEL.md` §E.2) with its shape and how it is stored; the loader, the tiny
writer, the sharding rules and the planner's byte counts all read it from here.

Two naming schemes (docs/DESIGN.md, "Parameter names"):

* **official** (`expected_tensors`): per-expert names ``layers.L.ffn.experts.e.w1.weight``; an fp8/fp4 weight
  has a ``.scale`` companion when quantised.
* **model** (`model_tensors`): the same names, dequantised (no ``.scale``), routed experts stacked
  ``layers.L.ffn.experts.w1.weight [E, F, D]``, ``w3 [E, F, D]``, ``w2 [E, D, F]``. With
  ``expert_format="fp4"`` the routed experts stay packed as stored (§E.1), each stacked projection as two
  uint8 tensors: ``layers.L.ffn.experts.wN.codes`` (e2m1 pairs, ``[E, F, D/2]`` for w1/w3, ``[E, D, F/2]`` for
  w2) and ``layers.L.ffn.experts.wN.scales`` (ue8m0 bytes, ``[E, F, D/32]`` / ``[E, D, F/32]``). With
  ``dense_format="fp8"`` the dense matrices the release stores in fp8 (`is_fp8_dense`) stay as stored too, under
  their official names: ``….weight`` e4m3 codes ``[out, in]`` and ``….scale`` ue8m0 bytes ``[⌈out/32⌉, ⌈in/32⌉]``.

Only the text model is listed by default, with its engram layers (`MODEL.md` §B.12) unless ``engram=False``. An
engram table is held as stored in both schemes (kind "fp8r": e4m3 rows ``layers.L.engram.embed.weight [rows, d]``
with one ue8m0 byte per row and 32 dims ``layers.L.engram.embed.scale [rows, d/32]``): 98 GB a layer in the
release, never dequantised. ``vision=True`` adds the image path (VISION.md §V.F): ``vision.*``, ``aligner.*``,
``image_start`` / ``image_newline`` / ``image_end`` and every backbone ``layers.L.ffn.gate.bias_vl`` (same names in
both schemes), after the text tensors. ``dspark=True`` adds the DSpark draft stages (`MODEL.md` §B.13, §E.2:
``mtp.s.*`` laid out as a window-only layer with ``dspark_n_routed_experts`` experts, plus ``mtp.0.main_proj`` /
``main_norm`` and the last stage's ``norm``, ``markov_head.{embed,head}`` and ``confidence_head.proj``); a stage's
routed experts stack as ``mtp.s.ffn.experts.wN.weight``. `skip_reason` names why a checkpoint tensor is left out.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from dsv41_jax.config import ModelConfig

# How a tensor is stored: plain floats, or quantised (§C.1, §E.1). "ue8m0" is the kind of a `.scale` companion.
PLAIN_KINDS = ("bf16", "f32")
QUANT_KINDS = ("fp8", "fp4")
TABLE_KIND = "fp8r"  # engram tables: e4m3 rows + one ue8m0 byte per row and 32 dims (stored and held so)
STORED_BYTES = {"bf16": 2.0, "f32": 4.0, "fp8": 1.0, "fp4": 1.0, "fp8r": 1.0, "ue8m0": 1.0}
FP8_BLOCK = 32  # fp8 weights: one ue8m0 scale per 32×32 block (§E.1)
FP4_GROUP = 32  # fp4 weights: one ue8m0 scale per row and 32 inputs (§E.1)


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: ``shape`` is the shape as stored (fp4: packed ``[out, in/2]`` int8).

    ``stored`` ∈ {"bf16", "f32", "fp8", "fp4", "ue8m0"}: "fp8" = e4m3 with a ``[⌈out/32⌉, ⌈in/32⌉]`` ue8m0
    ``.scale``; "fp4" = packed e2m1 with an ``[out, in/32]`` ue8m0 ``.scale``; "ue8m0" = such a scale.
    """

    name: str
    shape: tuple[int, ...]
    stored: str

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape) * STORED_BYTES[self.stored])


# ---------------------------------------------------------------------------------------------- layout rules
def fp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``[..., out, in]`` → ``[..., ⌈out/32⌉, ⌈in/32⌉]``."""
    *lead, out, inp = shape
    return (*lead, -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK))


def fp4_packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``[..., out, in]`` → ``[..., out, in/2]`` (two e2m1 codes a byte)."""
    *lead, out, inp = shape
    return (*lead, out, inp // 2)


def fp4_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``[..., out, in]`` → ``[..., out, ⌈in/32⌉]``."""
    *lead, out, inp = shape
    return (*lead, out, -(-inp // FP4_GROUP))


def stored_form(name: str, shape: tuple[int, ...], kind: str) -> dict[str, TensorSpec]:
    """The checkpoint tensors that hold the logical tensor ``name`` of ``shape`` stored as ``kind``.

    A plain kind gives one entry; "fp8" / "fp4" give ``name`` (codes) and its ``.scale`` companion.
    """
    if kind in PLAIN_KINDS:
        return {name: TensorSpec(name, tuple(shape), kind)}
    if not name.endswith(".weight"):
        raise ValueError(f"{name}: only '.weight' tensors can be quantised")
    scale = name.removesuffix(".weight") + ".scale"
    if kind == "fp8":
        return {name: TensorSpec(name, tuple(shape), "fp8"),
                scale: TensorSpec(scale, fp8_scale_shape(shape), "ue8m0")}
    if kind == "fp4":
        return {name: TensorSpec(name, fp4_packed_shape(shape), "fp4"),
                scale: TensorSpec(scale, fp4_scale_shape(shape), "ue8m0")}
    if kind == TABLE_KIND:
        return {name: TensorSpec(name, tuple(shape), TABLE_KIND),
                scale: TensorSpec(scale, fp4_scale_shape(shape), "ue8m0")}
    raise ValueError(f"unknown storage kind {kind!r}")


# ------------------------------------------------------------------------------------------------ inventory
def release_tensors(cfg: ModelConfig, *, vision: bool = False, engram: bool = True,
                    dspark: bool = False) -> list[TensorSpec]:
    """Every text-model tensor in official naming with its **logical** shape and the release's kind.

    Kinds: "fp8" / "fp4" for the matrices the release quantises, "fp8r" for engram tables, "bf16" / "f32"
    otherwise (§E.2; the f32 set follows §B.1: ``hc_*``, ``attn_sink``, ``gate.bias``, ``compressor.*``, and the
    engram ``q_weight`` / ``k_weight``). ``engram=False`` leaves the engram layers' tensors out; ``vision=True``
    appends `vision_tensors`.
    """
    out = [TensorSpec("embed.weight", (cfg.vocab_size, cfg.hidden_size), "bf16")]
    for layer in range(cfg.num_hidden_layers):
        if engram and layer in cfg.engram_layer_ids:
            out += engram_tensors(cfg, layer)
        out += _layer_tensors(cfg, layer)
    out.append(TensorSpec("norm.weight", (cfg.hidden_size,), "bf16"))
    if not cfg.tie_word_embeddings:
        out.append(TensorSpec("head.weight", (cfg.vocab_size, cfg.hidden_size), "bf16"))
    if vision:
        out += vision_tensors(cfg)
    if dspark:
        out += dspark_tensors(cfg)
    return out


def dspark_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    """``mtp.s.*`` for every stage (§B.13, §E.2): a window-only layer's tensors with the stage experts, then
    ``mtp.0.main_proj`` fp8 [D, n·D] and ``main_norm``, and the last stage's ``norm``, Markov head [V, R] ×2
    and ``confidence_head.proj`` [1, D + R]."""
    D, V, R = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
    out: list[TensorSpec] = []
    last = cfg.num_nextn_predict_layers - 1
    for s in range(cfg.num_nextn_predict_layers):
        p = f"mtp.{s}."
        layer = [TensorSpec(p + t.name.split(".", 2)[2], t.shape, t.stored)
                 for t in _layer_tensors(cfg, cfg.num_hidden_layers + s, cfg.dspark_n_routed_experts)]
        out += layer
        if s == 0:
            out += [TensorSpec(p + "main_proj.weight", (D, len(cfg.dspark_target_layer_ids) * D), "fp8"),
                    TensorSpec(p + "main_norm.weight", (D,), "bf16")]
        if s == last:
            out += [TensorSpec(p + "norm.weight", (D,), "bf16"),
                    TensorSpec(p + "markov_head.embed.weight", (V, R), "bf16"),
                    TensorSpec(p + "markov_head.head.weight", (V, R), "bf16"),
                    TensorSpec(p + "confidence_head.proj.weight", (1, D + R), "bf16")]
    return out


def n_experts(cfg: ModelConfig, owner) -> int:
    """Routed experts of ``owner``: a layer index, or a stage prefix ``"mtp.s"`` (`expert_name`'s first item)."""
    return cfg.dspark_n_routed_experts if isinstance(owner, str) else cfg.n_routed_experts


def vision_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    """The image path's tensors (VISION.md §V.F): the ViT, the aligner, the span delimiters and the backbone
    routers' ``bias_vl`` (f32). All plain floats; the names are the model's names too. ValueError without a
    vision config."""
    vc = cfg.vision
    if vc is None:
        raise ValueError("this config has no vision_config: no image path to list")
    C, D, P = vc.hidden_size, cfg.hidden_size, vc.patch_dim
    specs: list[tuple[str, tuple[int, ...], str]] = [("vision.patch_embed.proj.weight", (C, P), "bf16"),
                                                      ("vision.patch_embed.proj.bias", (C,), "bf16")]
    for i in range(vc.num_hidden_layers):
        b = f"vision.blocks.{i}."
        specs += [(b + "norm1.weight", (C,), "bf16"), (b + "norm2.weight", (C,), "bf16"),
                  (b + "attn.wqkv.weight", (3 * C, C), "bf16"), (b + "attn.wqkv.bias", (3 * C,), "bf16"),
                  (b + "attn.wo.weight", (C, C), "bf16"), (b + "attn.wo.bias", (C,), "bf16"),
                  (b + "mlp.w1.weight", (2 * vc.intermediate_size, C), "bf16"),
                  (b + "mlp.w2.weight", (C, vc.intermediate_size), "bf16")]
    r2 = vc.downsample_ratio**2
    specs += [("vision.norm.weight", (C,), "bf16"),
              ("aligner.w1.weight", (D, r2 * C), "bf16"), ("aligner.w1.bias", (D,), "bf16"),
              ("aligner.w2.weight", (D, D), "bf16"), ("aligner.w2.bias", (D,), "bf16"),
              ("image_start", (D,), "bf16"), ("image_newline", (D,), "bf16"), ("image_end", (D,), "bf16")]
    specs += [(f"layers.{L}.ffn.gate.bias_vl", (cfg.n_routed_experts,), "f32")
              for L in range(cfg.num_hidden_layers)]
    return [TensorSpec(name, shape, kind) for name, shape, kind in specs]
def engram_tensors(cfg: ModelConfig, layer: int) -> list[TensorSpec]:
    """``layers.L.engram.*`` (§E.2): the table, ``wkv`` ``[(S+1)·D, cols·d]`` fp8, ``q_weight`` / ``k_weight``."""
    p, s, d = f"layers.{layer}.engram.", cfg.hc_mult, cfg.hidden_size
    rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)]
    cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    return [TensorSpec(p + "embed.weight", (rows, cfg.engram_head_dim), TABLE_KIND),
            TensorSpec(p + "wkv.weight", ((s + 1) * d, cols * cfg.engram_head_dim), "fp8"),
            TensorSpec(p + "q_weight", (s, d), "f32"),
            TensorSpec(p + "k_weight", (s, d), "f32")]


# A stacked unit's model names (docs/DESIGN.md "Parameter names" item 3): ``layers.<unit>.<rest>`` [n, ...] holds
# the unit's per-layer tensors in order; ``<unit>`` lists its layers as ranges joined by "_": ``3-7`` (a run),
# ``24_28_32_36`` (a group's leads), ``25-27_29-31`` (a group's runs).
_STACKED = re.compile(r"layers\.(\d+(?:-\d+)?(?:_\d+(?:-\d+)?)*)\.(.+)")


def unit_name(unit: tuple[int, ...]) -> str:
    """A unit's name under ``layers`` (``ModelConfig.layer_units``): ``"L"`` for a layer alone, else its layers
    as ranges of consecutive ids joined by "_" (``"3-7"``, ``"24_28_32_36"``, ``"25-27_29-31"``)."""
    ranges: list[list[int]] = []
    for layer in unit:
        if ranges and layer == ranges[-1][-1] + 1:
            ranges[-1].append(layer)
        else:
            ranges.append([layer])
    return "_".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in ranges)


def _unit_layers(name: str) -> list[int]:
    out = []
    for part in name.split("_"):
        first, _, last = part.partition("-")
        out += list(range(int(first), int(last or first) + 1))
    return out


def is_stacked(name: str) -> bool:
    """True for a stacked unit's model name (``layers.3-7.attn.wq_a.weight``, ``layers.24_28.attn...``)."""
    m = _STACKED.fullmatch(name)
    return m is not None and ("-" in m[1] or "_" in m[1])


def layer_names(name: str) -> list[str]:
    """A model name as the per-layer names it holds: ``layers.3-7.attn.wq_a.weight`` [5, ...] →
    ``layers.3.attn.wq_a.weight`` … ``layers.7.attn.wq_a.weight`` (row i is the unit's i-th layer); any other
    name → [name]."""
    if not is_stacked(name):
        return [name]
    m = _STACKED.fullmatch(name)
    return [f"layers.{layer}.{m[2]}" for layer in _unit_layers(m[1])]


def is_engram_table(name: str) -> bool:
    """True for ``layers.L.engram.embed.weight`` / ``.scale`` (held as stored: e4m3 codes, ue8m0 bytes)."""
    return re.fullmatch(r"layers\.\d+\.engram\.embed\.(?:weight|scale)", name) is not None


def _layer_tensors(cfg: ModelConfig, layer: int, n_routed: int | None = None) -> list[TensorSpec]:
    D, hd, H, G = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.o_groups
    p = f"layers.{layer}."
    specs: list[tuple[str, tuple[int, ...], str]] = []
    for sub in ("attn", "ffn"):
        specs += [(f"hc_{sub}_fn", (cfg.hc_mix_width, cfg.hc_mult * D), "f32"),
                  (f"hc_{sub}_base", (cfg.hc_mix_width,), "f32"),
                  (f"hc_{sub}_scale", (3,), "f32")]
    specs += [
        ("attn_norm.weight", (D,), "bf16"),
        ("ffn_norm.weight", (D,), "bf16"),
        ("attn.wq_a.weight", (cfg.q_lora_rank, D), "fp8"),
        ("attn.q_norm.weight", (cfg.q_lora_rank,), "bf16"),
        ("attn.wq_b.weight", (H * hd, cfg.q_lora_rank), "fp8"),
        ("attn.wkv.weight", (hd, D), "fp8"),
        ("attn.kv_norm.weight", (hd,), "bf16"),
        ("attn.wo_a.weight", (G * cfg.o_lora_rank, H * hd // G), "fp8"),
        ("attn.wo_b.weight", (D, G * cfg.o_lora_rank), "fp8"),
        ("attn.attn_sink", (H,), "f32"),
    ]
    kv_source = layer in cfg.kv_source_layer_ids and cfg.ratio(layer) > 0
    index_source = layer in cfg.index_source_layer_ids and cfg.ratio(layer) > 0
    if kv_source:
        specs.append(("attn.compressor.wkv.weight", (hd, D), "f32"))
        if cfg.ratio(layer) == 2:
            specs.append(("attn.compressor.wgate.weight", (hd, D), "f32"))
        specs.append(("attn.compressor.norm.weight", (hd,), "f32"))
    if kv_source and index_source:
        specs += [("attn.indexer.wk.weight", (cfg.index_head_dim, hd), "bf16"),
                  ("attn.indexer.k_norm.weight", (cfg.index_head_dim,), "bf16")]
    if index_source:
        specs += [("attn.indexer.wq_b.weight", (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), "fp8"),
                  ("attn.indexer.weights_proj.weight", (cfg.index_n_heads, D), "bf16")]
    E, F = n_routed or cfg.n_routed_experts, cfg.moe_intermediate_size
    specs += [("ffn.gate.weight", (E, D), "bf16"), ("ffn.gate.bias", (E,), "f32")]
    for e in range(E):
        specs += [(f"ffn.experts.{e}.w1.weight", (F, D), "fp4"),
                  (f"ffn.experts.{e}.w3.weight", (F, D), "fp4"),
                  (f"ffn.experts.{e}.w2.weight", (D, F), "fp4")]
    if cfg.n_shared_experts:
        Fs = F * cfg.n_shared_experts
        specs += [("ffn.shared_experts.w1.weight", (Fs, D), "fp8"),
                  ("ffn.shared_experts.w3.weight", (Fs, D), "fp8"),
                  ("ffn.shared_experts.w2.weight", (D, Fs), "fp8")]
    return [TensorSpec(p + name, shape, kind) for name, shape, kind in specs]


def expected_tensors(cfg: ModelConfig, *, quantized: bool, vision: bool = False,
                     engram: bool = True, dspark: bool = False) -> dict[str, TensorSpec]:
    """Official name → stored spec of every text-model checkpoint tensor.

    ``quantized=True``: the release layout (fp8 dense, fp4 routed experts, each with its ``.scale``).
    ``quantized=False``: a plain-float checkpoint (the fp8/fp4 matrices stored bf16, no scales; engram tables
    stay fp8 rows). Skipped parts (see `skip_reason`) are not listed.
    """
    out: dict[str, TensorSpec] = {}
    for spec in release_tensors(cfg, vision=vision, engram=engram, dspark=dspark):
        kind = spec.stored if quantized or spec.stored in (*PLAIN_KINDS, TABLE_KIND) else "bf16"
        out.update(stored_form(spec.name, spec.shape, kind))
    return out


# ----------------------------------------------------------------------------------------------- model names
_EXPERT_NAME = re.compile(r"(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight")


def expert_name(name: str) -> tuple[int | str, int, str] | None:
    """``layers.L.ffn.experts.e.wN.weight`` → (L, e, "wN"); a DSpark stage's ``mtp.s.ffn.experts.e.wN.weight`` →
    ("mtp.s", e, "wN"); None for any other name."""
    m = _EXPERT_NAME.fullmatch(name)
    if not m:
        return None
    return (int(m[2]) if m[1] == "layers" else f"mtp.{m[2]}"), int(m[3]), m[4]


def _owner(layer: int | str) -> str:
    return layer if isinstance(layer, str) else f"layers.{layer}"


def stacked_expert_name(layer: int | str, proj: str) -> str:
    """The model name of the stacked routed-expert tensor ``proj`` ∈ {w1, w2, w3} of ``layer`` (or stage
    ``"mtp.s"``)."""
    return f"{_owner(layer)}.ffn.experts.{proj}.weight"


def model_name(official: str) -> str:
    """Official name of a text tensor → its model name (per-expert names map to the stacked tensor)."""
    hit = expert_name(official)
    return stacked_expert_name(hit[0], hit[2]) if hit else official


EXPERT_FORMATS = ("dequantized", "fp4")
DENSE_FORMATS = ("dequantized", "fp8")
PACKED_PARTS = ("codes", "scales")
# The dense matrices the release stores in fp8 (§E.2; ``release_tensors`` kind "fp8"), by model name: attention's
# projections, the indexer's query projection, the shared expert, DSpark's tap projection, engram's projection.
_FP8_DENSE = re.compile(
    r"(?:layers\.[\d_-]+|mtp\.\d+)\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|"
    r"ffn\.shared_experts\.w[123]|main_proj|engram\.wkv)\.(weight|scale)")


def is_fp8_dense(name: str) -> bool:
    """True for the model name of a dense matrix the release stores in fp8 (its ``.weight`` or ``.scale``; a
    stacked unit's name too): the tensors ``dense_format="fp8"`` holds as stored."""
    return _FP8_DENSE.fullmatch(name) is not None


def fp8_scale_name(weight: str) -> str:
    """``….weight`` → its ``….scale`` companion."""
    return weight.removesuffix(".weight") + ".scale"


def packed_expert_name(layer: int | str, proj: str, part: str) -> str:
    """The model name of the packed routed-expert ``part`` ∈ {codes, scales} of ``proj`` in ``layer``."""
    return f"{_owner(layer)}.ffn.experts.{proj}.{part}"


def packed_expert_shapes(stacked: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Stacked logical shape ``[E, out, in]`` → {"codes": ``[E, out, in/2]``, "scales": ``[E, out, in/32]``}."""
    return {"codes": fp4_packed_shape(stacked), "scales": fp4_scale_shape(stacked)}


def model_tensors(cfg: ModelConfig, expert_format: str = "dequantized", *,
                  vision: bool = False, engram: bool = True, dspark: bool = False,
                  dense_format: str = "dequantized") -> dict[str, tuple[int, ...]]:
    """Model name → shape; routed experts stacked (w1, w3 ``[E, F, D]``, w2 ``[E, D, F]``), dequantised or,
    with ``expert_format="fp4"``, as packed ``.codes`` / ``.scales`` (see the module docstring); engram tables
    as their codes and ``.scale`` bytes (``engram=False``: no engram tensors). ``dense_format="fp8"``: the fp8
    dense matrices as their codes (``.weight``) and ``.scale`` bytes. ``vision=True`` appends the image path
    (`vision_tensors`)."""
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert format {expert_format!r} must be one of {EXPERT_FORMATS}")
    if dense_format not in DENSE_FORMATS:
        raise ValueError(f"dense format {dense_format!r} must be one of {DENSE_FORMATS}")
    out: dict[str, tuple[int, ...]] = {}
    for spec in release_tensors(cfg, vision=vision, engram=engram, dspark=dspark):
        hit = expert_name(spec.name)
        if spec.stored == TABLE_KIND:
            out.update({n: t.shape for n, t in stored_form(spec.name, spec.shape, TABLE_KIND).items()})
        elif dense_format == "fp8" and hit is None and spec.stored == "fp8":
            out.update({n: t.shape for n, t in stored_form(spec.name, spec.shape, "fp8").items()})
        elif hit is None:
            out[spec.name] = spec.shape
        elif hit[1] == 0 and expert_format == "fp4":
            for part, shape in packed_expert_shapes((n_experts(cfg, hit[0]), *spec.shape)).items():
                out[packed_expert_name(hit[0], hit[2], part)] = shape
        elif hit[1] == 0:
            out[stacked_expert_name(hit[0], hit[2])] = (n_experts(cfg, hit[0]), *spec.shape)
    if cfg.tie_word_embeddings:
        out["head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return out


def model_dtype_kind(name: str) -> str:
    """"f32" for the parameters the model keeps in float32 (§B.1), else "model" (the model's dtype)."""
    f32_markers = (".hc_", ".attn_sink", ".gate.bias", ".compressor.", ".engram.q_weight", ".engram.k_weight")
    return "f32" if any(m in name for m in f32_markers) else "model"


# ------------------------------------------------------------------------------------------------ skipped parts
_SKIPPED = (
    (re.compile(r".*\.gate\.bias_vl$"), "image routing bias (gate.bias_vl)"),
    (re.compile(r"mtp\."), "DSpark draft stages (mtp.*; generate --speculate loads them)"),
    (re.compile(r"(.*\.)?engram\."), "engram (--skip-engram)"),
    (re.compile(r"(vision\.|aligner\.|image_)"), "vision tower"),
)


def skip_reason(name: str) -> str | None:
    """Why the text model leaves the checkpoint tensor ``name`` out, or None if it is not a skipped part."""
    for pattern, reason in _SKIPPED:
        if pattern.match(name):
            return reason
    return None
