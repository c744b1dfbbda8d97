"""Model configuration: a frozen dataclass read from an official ``config.json``.

The file may nest the text model under ``text_config`` (the released layout) or be flat (mlx-lm's tiny
test configs). Field names are the official ones (`docs/MODEL.md` §A.1). Layer roles (window / full / reindex /
reuse, `docs/MODEL.md` §A.2 and §B.9) are derived here once so every other module asks the config instead of
re-deriving them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .textfile import TextFileError, read_text


class ConfigError(ValueError):
    """A configuration the engine cannot run; the message says which field and why."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters for compressed layers (`docs/MODEL.md` §B.5)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower, aligner and image layout (docs/VISION.md §V.A; HF ``vision_config`` names).

    Defaults are the released values. ``patch_dim`` = 3·ps² (588), ``head_dim`` = C/h_v (64), ``cell`` = ps·r (42).
    """

    num_hidden_layers: int = 32
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None
    norm_eps: float = 1e-6  # not in the config: docs/VISION.md §V.A constants
    # The sharded model's run layout (set by `sharding.layout.ShardPlan.run_config`, never read from a file):
    # the fused rows of ``attn.wqkv`` (q, k, v) and ``mlp.w1`` (gate, up) are grouped rank by rank, so a rank's
    # contiguous row block holds all three (two) parts of its own heads (columns); each group holds
    # ``group_heads`` heads / ``group_mlp`` columns, zero padding included (0: H / G and I / G, no padding).
    shard_groups: int = 1
    group_heads: int = 0
    group_mlp: int = 0
    RUN_LAYOUT = ("norm_eps", "shard_groups", "group_heads", "group_mlp")  # fields no config file holds

    # The reference's flat ``ModelArgs`` names (docs/VISION.md §V.A) → the HF ``vision_config`` names.
    FLAT_NAMES = {"vision_n_layers": "num_hidden_layers", "vision_dim": "hidden_size",
                  "vision_n_heads": "num_attention_heads", "vision_inter_dim": "intermediate_size",
                  "vision_patch_size": "patch_size", "vision_rope_theta": "rope_theta",
                  "vision_downsample_ratio": "downsample_ratio", "vision_max_n_token": "max_image_tokens",
                  "vision_min_pixels": "min_pixels", "vision_max_wh_ratio": "max_wh_ratio"}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "VisionConfig | None":
        """A nested ``vision_config`` dict → VisionConfig; None when it has no layers (vision disabled)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"vision_config: {_shown(raw)} is {_kind(raw)}, wanted an object")
        names = {f.name for f in dataclasses.fields(cls)} - set(cls.RUN_LAYOUT)
        kwargs = {k: _checked(f"vision_config.{k}", v, _field_types(cls)[k]) for k, v in raw.items() if k in names}
        cfg = cls(**kwargs)
        if cfg.num_hidden_layers == 0:
            return None
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self.RUN_LAYOUT}

    def validate(self) -> None:
        for name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"):
            _require(getattr(self, name) >= 1, f"vision_config.{name} must be at least 1, got {getattr(self, name)}")
        _require(self.hidden_size % self.num_attention_heads == 0 and self.head_dim % 4 == 0,
                 f"vision hidden_size {self.hidden_size} / num_attention_heads {self.num_attention_heads} must be "
                 f"a whole head dim divisible by 4 (2-D RoPE)")
        _require(self.patch_size >= 1 and self.downsample_ratio >= 1, "vision patch_size and downsample_ratio "
                 "must be positive")
        _require(self.max_image_tokens >= 5, f"vision max_image_tokens {self.max_image_tokens} is below 5 "
                 f"(one token plus its newline and the two delimiters)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def heads_per_group(self) -> int:
        return self.group_heads or self.num_attention_heads // self.shard_groups

    @property
    def mlp_per_group(self) -> int:
        return self.group_mlp or self.intermediate_size // self.shard_groups

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size**2

    @property
    def cell(self) -> int:
        return self.patch_size * self.downsample_ratio


def _vision_from_raw(raw: dict[str, Any]) -> VisionConfig | None:
    """``vision_config`` (nested, HF names) or the reference's flat ``vision_*`` names; None if absent."""
    nested = raw.get("vision_config")
    if nested:
        return VisionConfig.from_dict(nested)
    flat = {VisionConfig.FLAT_NAMES[k]: v for k, v in raw.items() if k in VisionConfig.FLAT_NAMES}
    return VisionConfig.from_dict(flat) if flat else None


@dataclass(frozen=True)
class ModelConfig:
    """The V4.1 text model's configuration (official field names; defaults are the released values)."""

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: RopeScaling | None = RopeScaling()
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = ()
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 384
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    gate_temp: float = 1.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Token ids.
    bos_token_id: int = 0
    eos_token_id: int | tuple[int, ...] = 1
    pad_token_id: int = 2
    image_token_id: int | None = None
    image_pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    # Engram (`docs/MODEL.md` §B.12).
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16000000
    engram_compressed_vocab_size: int = 99092
    engram_pad_token_id: int = 2
    # DSpark draft stages (`docs/MODEL.md` §B.13).
    num_nextn_predict_layers: int = 0
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # The quantization_config of the file (None for a plain-float checkpoint).
    quantization: dict[str, Any] | None = field(default=None, compare=False)
    # The image path (docs/VISION.md); None: text only.
    vision: VisionConfig | None = None

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from an official config dict (nested under ``text_config`` or flat); checks every known field's
        JSON type (`_checked`: the error names the field, its value and the type wanted), then validates.
        Unknown keys (``architectures``, ``torch_dtype``, ...) are left alone."""
        if not isinstance(raw, dict):
            raise ConfigError(f"the config is {_kind(raw)}, wanted a JSON object")
        model_type = raw.get("model_type", "deepseek_v41")
        if model_type not in ("deepseek_v41", "deepseek_v41_text"):
            raise ConfigError(f"model_type {model_type!r} is not DeepSeek-V4.1 (expected 'deepseek_v41')")
        text = raw.get("text_config") or {}
        if not isinstance(text, dict):
            raise ConfigError(f"text_config: {_shown(text)} is {_kind(text)}, wanted an object")
        merged = {**{k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}, **text}
        hints = _field_types(cls)
        kwargs: dict[str, Any] = {}
        for key, value in merged.items():
            if key == "quantization_config":
                kwargs["quantization"] = _quantization(value)
            elif key == "rope_scaling":
                kwargs["rope_scaling"] = _rope_scaling(value)
            elif key in hints and key not in ("quantization", "vision", "rope_scaling"):
                kwargs[key] = _checked(key, value, hints[key])
        kwargs["vision"] = _vision_from_raw(raw)
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        """Read ``path`` (a ``config.json`` or a checkpoint directory holding one); a ConfigError names the file."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config file at {path}")
        try:
            raw = json.loads(read_text(path, "config file"))
        except TextFileError as e:
            raise ConfigError(str(e)) from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """A flat official-style dict (what ``make_tiny`` writes as ``config.json``)."""
        out: dict[str, Any] = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"]}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "vision":
                if value is not None:
                    out["vision_config"] = value.to_dict()
                continue
            if f.name == "quantization":
                if value is not None:
                    out["quantization_config"] = value
                continue
            if f.name == "rope_scaling" and value is not None:
                value = {"rope_type": "yarn", **dataclasses.asdict(value)}
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def replace(self, **changes: Any) -> "ModelConfig":
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    # ------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise ConfigError naming the first rule the config breaks (`docs/MODEL.md` §B.9)."""
        n = self.num_hidden_layers
        for name in _POSITIVE_FIELDS:
            _require(getattr(self, name) >= 1, f"{name} must be at least 1, got {getattr(self, name)}")
        _require(self.scoring_func == "sqrtsoftplus",
                 f"scoring_func {self.scoring_func!r} is not supported (V4.1 uses 'sqrtsoftplus')")
        _require(self.hidden_act == "silu", f"hidden_act {self.hidden_act!r} is not supported (expected 'silu')")
        _require(self.num_key_value_heads == 1, "num_key_value_heads must be 1 (one shared KV latent)")
        _require(self.num_attention_heads % self.o_groups == 0,
                 f"num_attention_heads {self.num_attention_heads} is not divisible by o_groups {self.o_groups}")
        _require(0 < self.qk_rope_head_dim <= self.head_dim and self.qk_rope_head_dim % 2 == 0,
                 f"qk_rope_head_dim {self.qk_rope_head_dim} must be even and at most head_dim {self.head_dim}")
        _require(self.qk_rope_head_dim <= self.index_head_dim,
                 f"qk_rope_head_dim {self.qk_rope_head_dim} exceeds index_head_dim {self.index_head_dim}")
        _require(len(self.compress_ratios) >= n,
                 f"compress_ratios has {len(self.compress_ratios)} entries, fewer than num_hidden_layers {n}")
        for i, r in enumerate(self.compress_ratios):
            _require(r in (0, 1, 2), f"compress_ratios[{i}] = {r}: only 0, 1 and 2 are supported")
        _require(1 <= self.num_experts_per_tok <= self.n_routed_experts,
                 f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..n_routed_experts "
                 f"({self.n_routed_experts})")
        _require(self.n_shared_experts in (0, 1), f"n_shared_experts {self.n_shared_experts} must be 0 or 1")
        _require(self.sliding_window >= 1, "sliding_window must be at least 1")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            for lid in getattr(self, name):
                _require(0 <= lid < n, f"{name} names layer {lid}, outside 0..{n - 1}")
        for lid in self.kv_source_layer_ids:
            _require(self.ratio(lid) > 0, f"kv source layer {lid} has compress ratio 0: a kv source must compress")
        for lid in self.index_source_layer_ids:
            _require(self.ratio(lid) > 0, f"index source layer {lid} has compress ratio 0")
        for lid in range(n):
            if self.ratio(lid) == 0:
                continue
            src = self.kv_source(lid)
            _require(src is not None, f"layer {lid} compresses but no kv source layer is at or before it")
            _require(self.ratio(src) == self.ratio(lid),
                     f"layer {lid} (ratio {self.ratio(lid)}) reads kv source {src} of ratio {self.ratio(src)}")
            idx = self.index_source(lid)
            _require(idx is not None, f"layer {lid} compresses but no index source layer is at or before it")
            _require(self.kv_source(idx) == src,
                     f"layer {lid} takes its top-k from layer {idx}, which indexes kv source "
                     f"{self.kv_source(idx)}, not the cache {src} it attends to")
            if lid in self.index_source_layer_ids:
                _require(self.index_key_source(lid) is not None,
                         f"index source layer {lid} has no kv-and-index source at or before it for its keys")
        c = self.candidate_source_layer_id
        if c >= 0:
            _require(c < n and c in self.kv_source_layer_ids and c in self.index_source_layer_ids,
                     f"candidate_source_layer_id {c} must be a full layer (kv source and index source)")
            _require(self.candidate_block_size >= 1 and self.candidate_topk_blocks >= 1,
                     "candidate_block_size and candidate_topk_blocks must be positive")
        if self.engram_layer_ids:
            _require(len(self.engram_num_embeddings) == len(self.engram_layer_ids),
                     f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries for "
                     f"{len(self.engram_layer_ids)} engram layers")
        if self.num_nextn_predict_layers:
            _require(len(self.compress_ratios) >= n + self.num_nextn_predict_layers,
                     "compress_ratios must also list the DSpark stages")
        if self.vision is not None:
            _require(self.image_token_id is not None and 0 <= self.image_token_id < self.vocab_size,
                     f"a config with a vision_config needs image_token_id inside the vocabulary, got "
                     f"{self.image_token_id}")

    # ---------------------------------------------------------------- roles
    def ratio(self, layer: int) -> int:
        """Compress ratio of ``layer`` (0 = window only)."""
        return int(self.compress_ratios[layer])

    def kv_source(self, layer: int) -> int | None:
        """kv_src(L): the layer whose compressed entries ``layer`` attends to (§B.9)."""
        cands = [s for s in self.kv_source_layer_ids if s <= layer and self.ratio(s) > 0]
        return max(cands) if cands and self.ratio(layer) > 0 else None

    def index_source(self, layer: int) -> int | None:
        """idx_src(L): the layer whose top-k ``layer`` uses (§B.9)."""
        cands = [s for s in self.index_source_layer_ids if s <= layer]
        return max(cands) if cands and self.ratio(layer) > 0 else None

    def index_key_source(self, layer: int) -> int | None:
        """ik_src(L): the kv-and-index source whose index keys ``layer`` scores (§B.9)."""
        both = set(self.kv_source_layer_ids) & set(self.index_source_layer_ids)
        cands = [s for s in both if s <= layer]
        return max(cands) if cands and self.ratio(layer) > 0 else None

    def uses_candidates(self, layer: int) -> bool:
        """True for an index source after the candidate source (its scores are candidate-masked)."""
        c = self.candidate_source_layer_id
        return layer in self.index_source_layer_ids and 0 <= c < layer

    def role(self, layer: int) -> str:
        """'window', 'full' (owns compressor, index keys, indexer), 'reindex' or 'reuse' (§A.2)."""
        if self.ratio(layer) == 0:
            return "window"
        if layer in self.kv_source_layer_ids:
            return "full"
        if layer in self.index_source_layer_ids:
            return "reindex"
        return "reuse"

    def layer_units(self) -> tuple[tuple[int, ...], ...]:
        """The layers as the model holds them (docs/DESIGN.md "Scanned layers"), in ``layer_steps`` order: a
        unit of one layer, or of n layers whose weights are stacked ``[n, ...]`` (a run, or the leads or the runs
        of a group)."""
        return tuple(unit for step in self.layer_steps() for unit in step)

    def layer_steps(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """How the forward runs the layers, in order (docs/DESIGN.md "Scanned layers"); each step is

        * ``(unit,)``: one layer, or a **run** — two or more consecutive reuse layers of one signature (ratio, kv
          source, index source; no engram), one ``lax.scan``. A reuse layer only reads the CSA state of layers
          before its run and publishes nothing (§B.9);
        * ``(leads, runs)``: a **group scan** — G ≥ 2 repeats of (a reindex layer, the run of n reuse layers that
          uses its selections), one ``lax.scan`` over the repeats: ``leads`` the G reindex layers, ``runs`` their
          G·n reuse layers in order. The leads share a signature (ratio, kv and index-key source, candidate
          masking; no compressor, so their caches are window rings), the runs a length and signature, and no
          layer outside a repeat reads what its lead publishes.
        """
        steps: list[tuple[tuple[int, ...], ...]] = []
        units = self._runs()
        i = 0
        while i < len(units):
            g = self._group_length(units, i)
            if g >= 2:
                pairs = units[i:i + 2 * g]
                steps.append((tuple(u[0] for u in pairs[0::2]), tuple(x for u in pairs[1::2] for x in u)))
                i += 2 * g
            else:
                steps.append((units[i],))
                i += 1
        return tuple(steps)

    def _runs(self) -> list[tuple[int, ...]]:
        """Single layers and runs of consecutive same-signature reuse layers, in layer order."""
        def signature(layer: int):
            if self.role(layer) != "reuse" or layer in self.engram_layer_ids:
                return None
            return self.ratio(layer), self.kv_source(layer), self.index_source(layer)

        units: list[list[int]] = []
        for layer in range(self.num_hidden_layers):
            sig = signature(layer)
            if units and sig is not None and signature(units[-1][-1]) == sig:
                units[-1].append(layer)
            else:
                units.append([layer])
        return [tuple(u) for u in units]

    def _group_length(self, units: list[tuple[int, ...]], i: int) -> int:
        """How many (reindex layer, its run) repeats start at ``units[i]`` (0 or 1: no group)."""
        def repeat_signature(j: int):
            """What must match between repeats, for the pair units[j], units[j + 1]; None: no repeat starts here."""
            if j + 1 >= len(units):
                return None
            lead, run = units[j], units[j + 1]
            layer = lead[0]
            if len(lead) != 1 or self.role(layer) != "reindex" or layer in self.engram_layer_ids:
                return None
            if not all(self.role(x) == "reuse" and x not in self.engram_layer_ids for x in run):
                return None
            readers = {x for x in range(self.num_hidden_layers) if x != layer and layer in (
                self.index_source(x), self.kv_source(x), self.index_key_source(x))}
            if readers != set(run):  # only its run reads what the lead publishes
                return None
            return (self.ratio(layer), self.kv_source(layer), self.index_key_source(layer),
                    self.uses_candidates(layer), layer == self.candidate_source_layer_id,
                    len(run), self.ratio(run[0]), self.kv_source(run[0]))

        first = repeat_signature(i)
        if first is None:
            return 0
        g = 1
        while repeat_signature(i + 2 * g) == first:
            g += 1
        return g

    # -------------------------------------------------------------- derived
    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        return tuple(e) if isinstance(e, (tuple, list)) else (int(e),)

    @property
    def hc_mix_width(self) -> int:
        """(2 + S) · S: pre, post and the S×S comb (§B.3)."""
        return (2 + self.hc_mult) * self.hc_mult

    def unsupported_features(self) -> list[str]:
        """Parts of the config the plain model does not run (DSpark: only speculative decoding runs them)."""
        out = []
        if self.num_nextn_predict_layers:
            out.append(f"DSpark draft stages ({self.num_nextn_predict_layers}); the target model runs without them "
                       f"unless speculative decoding loads them (generate --speculate)")
        return out

    @property
    def has_vision(self) -> bool:
        return self.vision is not None


def _rope_scaling(value: Any) -> RopeScaling | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"rope_scaling: {_shown(value)} is {_kind(value)}, wanted an object or null")
    kind = value.get("rope_type", value.get("type", "yarn"))
    if kind != "yarn":
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (V4.1 uses 'yarn')")
    if value.get("mscale") not in (None, 1, 1.0) or value.get("mscale_all_dim") not in (None, 0, 1, 1.0):
        raise ConfigError("rope_scaling with an mscale amplitude factor is not supported")
    hints = _field_types(RopeScaling)  # int / float fields: held as that type (16 and 16.0 alike)
    return RopeScaling(**{k: hints[k](_checked(f"rope_scaling.{k}", v, hints[k])) for k, v in value.items()
                          if k in hints})


def _quantization(value: Any) -> dict[str, Any] | None:
    """``quantization_config``: null or an object whose format names (when given) are strings."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"quantization_config: {_shown(value)} is {_kind(value)}, wanted an object or null")
    for key in ("quant_method", "expert_dtype", "scale_fmt", "activation_scheme"):
        if key in value:
            _checked(f"quantization_config.{key}", value[key], str)
    if "weight_block_size" in value:
        _checked("quantization_config.weight_block_size", value["weight_block_size"], tuple[int, ...])
    return value


# Sizes and counts that divide or index something: a 0 (or a negative) would fail deep inside the model.
_POSITIVE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                    "q_lora_rank", "o_lora_rank", "o_groups", "max_position_embeddings", "index_n_heads",
                    "index_head_dim", "index_topk", "n_routed_experts", "moe_intermediate_size", "hc_mult")


@functools.cache
def _field_types(cls) -> dict[str, Any]:
    """A config dataclass's field name → its resolved type annotation."""
    return typing.get_type_hints(cls)


def _checked(name: str, value: Any, hint: Any) -> Any:
    """``value`` of the config field ``name`` as the dataclass holds it (a JSON list as a tuple), or a ConfigError
    naming the field, the value and the JSON type wanted (e.g. ``num_hidden_layers: "ten" is a string, wanted an
    integer``). JSON's true/false are not integers here (Python's bool is an int), an integer is a number."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if isinstance(value, (list, tuple)) and any(typing.get_origin(h) is tuple for h in options):
            return _checked(name, value, next(h for h in options if typing.get_origin(h) is tuple))
        if any(_is(value, h) for h in options):
            return value
    elif typing.get_origin(hint) is tuple and isinstance(value, (list, tuple)):
        (item, _) = typing.get_args(hint)  # tuple[int, ...]
        return tuple(_checked(f"{name}[{i}]", v, item) for i, v in enumerate(value))
    elif _is(value, hint):
        return value
    got = f"{name} is null" if value is None else f"{name}: {_shown(value)} is {_kind(value)}"
    raise ConfigError(f"{got}, wanted {_wanted(hint)}")


def _is(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if typing.get_origin(hint) is dict:
        return isinstance(value, dict)
    if typing.get_origin(hint) is tuple:
        return isinstance(value, (list, tuple)) and all(_is(v, typing.get_args(hint)[0]) for v in value)
    return False


_WANTED = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string", type(None): "null"}


def _wanted(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_wanted(h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"a list of {_wanted(typing.get_args(hint)[0]).removeprefix('an ').removeprefix('a ')}s"
    if typing.get_origin(hint) is dict:
        return "an object"
    return _WANTED.get(hint, str(hint))


def _kind(value: Any) -> str:
    """The JSON type of ``value``, with its article."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number" if math.isfinite(value) else "not a finite number"
    return {str: "a string", list: "a list", tuple: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    """``value`` as JSON, cut to a readable length."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# The named configs: the repository's top-level ``configs/`` (one source), reached inside the package through the
# link ``dsv41_jax/configs`` and shipped in the wheel as package data, so a source tree, an editable install and
# a wheel install all read the same files. A source tree whose link did not survive (a checkout without symlink
# support leaves a small text file) reads the top-level folder itself.
CONFIG_DIR = importlib.resources.files("dsv41_jax") / "configs"
if not CONFIG_DIR.is_dir():
    CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def config_names() -> list[str]:
    """The names ``load_named`` knows (``tiny``, ``dsv41_flash``, ...)."""
    return sorted(p.name.removesuffix(".json") for p in CONFIG_DIR.iterdir() if p.name.endswith(".json"))


def load_named(name_or_path: str) -> ModelConfig:
    """The one way every command (generate, serve, plan, make_tiny, profile, the benchmarks) reads ``--config``:
    a name of ``configs/`` (``tiny``, ``tiny_engram``, ``tiny_vision``, ``dsv41_flash``; inside the installed
    package) or a path to a config.json / checkpoint directory; an existing path wins over a name. A ConfigError
    names what is wrong (an unknown name lists the known ones)."""
    if _is_name(name_or_path):
        with importlib.resources.as_file(CONFIG_DIR / f"{name_or_path}.json") as file:
            return ModelConfig.from_json(file)
    return ModelConfig.from_json(_config_path(name_or_path))


def config_label(name_or_path: str) -> str:
    """How to name the config ``name_or_path`` in messages: ``configs/tiny.json`` for a name, else the path."""
    return f"configs/{name_or_path}.json" if _is_name(name_or_path) else str(name_or_path)


def _is_name(name_or_path: str) -> bool:
    return not Path(name_or_path).exists() and (CONFIG_DIR / f"{name_or_path}.json").is_file()


def _config_path(name_or_path: str) -> Path:
    """The existing file (or checkpoint directory) ``name_or_path`` that is not a name (see `load_named`)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    known = ", ".join(config_names())
    if len(p.parts) == 1 and not p.suffix:
        raise ConfigError(f"no config named {name_or_path!r} (known: {known}) and no file at {name_or_path}")
    raise ConfigError(f"no config file at {name_or_path} (the named configs: {known})")


def yarn_inv_freq(cfg: ModelConfig, layer_ratio: int) -> list[float]:
    """Per-pair RoPE frequencies f_i for a layer of the given compress ratio (§B.5), as Python floats."""
    d_r = cfg.rope_dim
    if layer_ratio == 0 or cfg.rope_scaling is None:
        base = cfg.rope_theta if layer_ratio == 0 else cfg.compress_rope_theta
        return [base ** (-2.0 * i / d_r) for i in range(d_r // 2)]
    theta, ys = cfg.compress_rope_theta, cfg.rope_scaling

    def g(beta: float) -> float:
        return d_r * math.log(ys.original_max_position_embeddings / (2 * math.pi * beta)) / (2 * math.log(theta))

    lo = max(math.floor(g(ys.beta_fast)), 0)
    hi = min(math.ceil(g(ys.beta_slow)), d_r - 1)
    if lo == hi:
        hi += 0.001
    out = []
    for i in range(d_r // 2):
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        base = theta ** (-2.0 * i / d_r)
        out.append(base * (1 - ramp) + base / ys.factor * ramp)
    return out
