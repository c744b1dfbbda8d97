"""Random DeepSeek-V4.1 checkpoints in the official format, for tests and parity runs.

    python -m dsv41_jax.make_tiny OUT [--config FILE|tiny] [--seed N] [--quantize none|fp8|fp4] [--dspark] [--force]

``--quantize`` picks how the matrices the release quantises are stored (`docs/MODEL.md` §E.1):

* ``none``: every matrix bf16 (no ``quantization_config``);
* ``fp8``:  dense matrices fp8 (e4m3, 32×32 ue8m0 scales), routed experts bf16;
* ``fp4``:  the release layout: dense fp8, routed experts fp4 (packed e2m1, per-32 ue8m0 scales).

Other tensors are bf16 or f32 as `param_specs.release_tensors` says. Engram tables are always fp8 rows (e4m3 +
a ue8m0 byte per row and 32 dims, as released and as the model holds them), and a config with engram layers
whose compressed vocabulary is its vocabulary (TINY-E) gets the identity ``engram_token_map.json``.
``--dspark`` (``dspark=True``) also writes the config's DSpark draft stages ``mtp.*`` (`param_specs.dspark_tensors`,
drawn after every other tensor, so the target's weights equal those of the same seed without them).
`write_checkpoint` returns the values as stored (dequantised, float32, model names; engram tables as their
codes and scale bytes), so a model and an oracle loading the directory see exactly them.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from dsv41_jax import formats, param_specs
from dsv41_jax.config import ConfigError, ModelConfig, load_named
from dsv41_jax.engram import TOKEN_MAP_FILE

QUANTIZE_MODES = ("none", "fp8", "fp4")
QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                       "scale_fmt": "ue8m0"}


# ------------------------------------------------------------------------------------------------- weights
RANDOM_LIMIT_BYTES = 4 << 30  # random float32 weights above this are not a "tiny" model: refused up front


def random_weights_bytes(cfg: ModelConfig, dspark: bool = False) -> int:
    """Bytes of ``random_weights(cfg)`` (float32, every model tensor)."""
    shapes = param_specs.model_tensors(cfg, vision=cfg.has_vision, dspark=dspark)
    return 4 * sum(math.prod(s) for s in shapes.values())


def check_random_size(cfg: ModelConfig) -> None:
    """ValueError (one line) when ``random_weights(cfg)`` would need more than ``RANDOM_LIMIT_BYTES``."""
    need = random_weights_bytes(cfg)
    if need > RANDOM_LIMIT_BYTES:
        raise ValueError(f"random weights for this config need {need / 2**30:,.1f} GiB of host memory (float32), "
                         f"over the {RANDOM_LIMIT_BYTES / 2**30:.0f} GiB limit for a random test model; use a "
                         f"smaller config (e.g. tiny) or real weights")


def random_weights(cfg: ModelConfig, seed: int = 0, *, dspark: bool = False) -> dict[str, np.ndarray]:
    """Model name → float32 random weights scaled so activations stay O(1) through every layer.

    Linear weights ~ N(0, 1/fan_in); norm weights ~ 1 ± 0.1; the HC ``fn`` small (mix logits of std ≈ 0.3, so
    the pre/post/comb mixes stay near uniform); router bias and attention sinks near 0; embedding N(0, 1).
    Values are already on the grid of their plain storage (bf16 or f32), so ``write_checkpoint(...,
    "none")`` stores them exactly. A config with a ``vision_config`` also gets the image path's tensors
    (docs/VISION.md §V.F), drawn after the text ones (so the text weights equal those of the same config without it).
    """
    rng = np.random.default_rng(seed)
    vision = cfg.has_vision
    dspark = dspark and cfg.num_nextn_predict_layers > 0
    kinds = {_model_name(s.name): s.stored for s in param_specs.release_tensors(cfg, vision=vision, dspark=dspark)}
    out = {}
    for name, shape in param_specs.model_tensors(cfg, vision=vision, dspark=dspark).items():
        if param_specs.is_engram_table(name):  # codes and scale bytes as stored; rows ~ N(0, 1)
            if name.endswith(".weight"):
                codes, scale = formats.fp8_rows_quantize(rng.standard_normal(shape).astype(np.float32))
                out[name], out[name.removesuffix(".weight") + ".scale"] = codes, scale.view(np.uint8)
            continue
        w = _init(name, shape, cfg, rng)
        out[name] = formats.round_trip(w, "f32" if kinds.get(name, "bf16") == "f32" else "bf16")
    return out


def _model_name(official: str) -> str:
    return param_specs.model_name(official)


def _init(name: str, shape: tuple[int, ...], cfg: ModelConfig, rng: np.random.Generator) -> np.ndarray:
    def normal(std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    if name == "embed.weight":
        return normal(1.0)
    if name.endswith("norm.weight"):  # every RMSNorm weight
        return 1.0 + normal(0.1)
    if name.endswith("_fn"):
        return normal(0.3 / math.sqrt(shape[-1]))
    if name.endswith("_base"):
        return normal(0.2)
    if name.endswith("_scale"):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if name.endswith(".attn_sink"):
        return normal(0.1)
    if name.endswith(".gate.bias") or name.endswith(".gate.bias_vl"):
        return normal(0.05)
    if name.startswith("image_"):  # span delimiters replace embedding rows: the embedding's scale
        return normal(1.0)
    if name.endswith((".engram.q_weight", ".engram.k_weight")):
        return 1.0 + normal(0.3)
    return normal(1.0 / math.sqrt(shape[-1]))  # every linear: [.., out, in]


# ------------------------------------------------------------------------------------------------- storage
def storage_kinds(cfg: ModelConfig, quantize: str, dspark: bool = False) -> dict[str, str]:
    """Official name → how ``write_checkpoint`` stores it under ``quantize`` (see the module docstring)."""
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, not {quantize!r}")
    out = {}
    for spec in param_specs.release_tensors(cfg, vision=cfg.has_vision, dspark=dspark):
        kind = spec.stored
        if kind == "fp4" and quantize != "fp4" or kind == "fp8" and quantize == "none":
            kind = "bf16"
        if kind in (*param_specs.QUANT_KINDS, param_specs.TABLE_KIND) and spec.shape[-1] % formats.BLOCK:
            raise ValueError(f"{spec.name} {list(spec.shape)}: a {kind} matrix needs its input dim to be a "
                             f"multiple of {formats.BLOCK}; use --quantize none for this config")
        out[spec.name] = kind
    return out


def encode(cfg: ModelConfig, weights: dict[str, np.ndarray],
           quantize: str) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    """Yield ``(official name, {checkpoint name: stored array})`` for every text tensor (and the DSpark stages'
    when ``weights`` hold them), in inventory order."""
    dspark = any(k.startswith("mtp.") for k in weights)
    for name, kind in storage_kinds(cfg, quantize, dspark).items():
        hit = param_specs.expert_name(name)
        src = weights[_model_name(name)]
        w = src[hit[1]] if hit else src
        if kind == param_specs.TABLE_KIND:
            scale = name.removesuffix(".weight") + ".scale"
            yield name, {name: w, scale: formats.as_ue8m0(weights[scale])}
        elif kind == "bf16":
            yield name, {name: np.asarray(w, dtype=np.float32).astype(ml_dtypes.bfloat16)}
        elif kind == "f32":
            yield name, {name: np.asarray(w, dtype=np.float32)}
        else:
            codes, scale = formats.fp8_quantize(w) if kind == "fp8" else formats.fp4_quantize(w)
            yield name, {name: codes, name.removesuffix(".weight") + ".scale": scale}


def _decode(stored: dict[str, np.ndarray], name: str) -> np.ndarray:
    w = stored[name]
    scale = stored.get(name.removesuffix(".weight") + ".scale")
    if scale is None:
        return w.astype(np.float32)
    if w.dtype == np.int8:
        return formats.fp4_dequantize(w, scale)
    return formats.fp8_dequantize(w, scale)


def write_checkpoint(out_dir: str | Path, cfg: ModelConfig, weights: dict[str, np.ndarray],
                     quantize: str = "none", *, shard_bytes: int = 2 << 20) -> dict[str, np.ndarray]:
    """Write ``config.json``, safetensors shards and ``model.safetensors.index.json`` into ``out_dir``.

    ``weights``: model names (as `random_weights`). Returns model name → float32 values as stored (what
    `checkpoint.load_checkpoint` gives back). Each ``layers.L.ffn.gate.bias_vl`` is written as a copy of the
    router bias, as in the release, unless the config has a vision_config: then the weights hold the image
    path too (`random_weights`), ``bias_vl`` included, and it is written from them.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    missing = set(param_specs.model_tensors(cfg, vision=cfg.has_vision)) - set(weights)  # stages: optional
    if missing:
        raise ValueError(f"weights lack {sorted(missing)[0]} (and {len(missing) - 1} more)")
    stored_values: dict[str, np.ndarray] = {}
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, tensors in encode(cfg, weights, quantize):
        if param_specs.is_engram_table(name):
            stored_values.update({k: v if k == name else v.view(np.uint8) for k, v in tensors.items()})
        else:
            _place(stored_values, cfg, name, _decode(tensors, name))
        if name.endswith(".ffn.gate.bias") and not cfg.has_vision:
            tensors = {**tensors, name + "_vl": tensors[name].copy()}
        nbytes = sum(t.nbytes for t in tensors.values())
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1].update(tensors)
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: np.ascontiguousarray(v) for k, v in shard.items()}, str(out_dir / file))
        weight_map.update({k: file for k in shard})
        total += sum(v.nbytes for v in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "config.json").write_text(json.dumps(_config_dict(cfg, quantize), indent=2) + "\n")
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if cfg.engram_layer_ids and cfg.engram_compressed_vocab_size == cfg.vocab_size:
        (out_dir / TOKEN_MAP_FILE).write_text(json.dumps(list(range(cfg.vocab_size))) + "\n")
    return stored_values


def _place(out: dict[str, np.ndarray], cfg: ModelConfig, official: str, value: np.ndarray) -> None:
    hit = param_specs.expert_name(official)
    if hit is None:
        out[official] = value
        return
    name = param_specs.stacked_expert_name(hit[0], hit[2])
    if name not in out:
        out[name] = np.empty((param_specs.n_experts(cfg, hit[0]), *value.shape), dtype=np.float32)
    out[name][hit[1]] = value


def _config_dict(cfg: ModelConfig, quantize: str) -> dict:
    quant = None
    if quantize != "none":
        quant = {**QUANTIZATION_CONFIG, "expert_dtype": "fp4" if quantize == "fp4" else "bf16"}
    return cfg.replace(quantization=quant).to_dict()


# ------------------------------------------------------------------------------------------------------ CLI
EXAMPLES = """\
examples:
  python -m dsv41_jax.make_tiny /tmp/tiny                          # configs/tiny.json, every matrix bf16
  python -m dsv41_jax.make_tiny /tmp/tiny-fp4 --quantize fp4       # the release's layout: fp8 dense, fp4 experts
  python -m dsv41_jax.make_tiny /tmp/tiny-e --config tiny_engram   # with engram layers (and their token map)
  python -m dsv41_jax.make_tiny /tmp/tiny-v --config tiny_vision   # with a vision tower
  python -m dsv41_jax.make_tiny /tmp/tiny-d --dspark --seed 3 --force   # with the DSpark stages (mtp.*)
  python -m dsv41_jax.generate --checkpoint /tmp/tiny --prompt "Hi"     # then run it

The weights are random (the output is not language): for tests, parity runs and trying the CLIs without the
release. A config whose random weights would pass 4 GiB (e.g. dsv41_flash) is refused.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsv41_jax.make_tiny",
                                     description="Write a random DeepSeek-V4.1 checkpoint in the official format.",
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="output directory (must be empty or absent unless --force)")
    parser.add_argument("--config", default="tiny",
                        help="tiny, tiny_engram, tiny_vision, or a config.json path (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--quantize", choices=QUANTIZE_MODES, default="none",
                        help="none: all bf16; fp8: dense fp8; fp4: dense fp8 + fp4 experts (the release)")
    parser.add_argument("--dspark", action="store_true",
                        help="also write the config's DSpark draft stages (mtp.*, docs/MODEL.md §B.13)")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        cfg = load_named(args.config)
        if args.dspark and not cfg.num_nextn_predict_layers:
            raise ValueError("--dspark: this config has no DSpark stages (num_nextn_predict_layers is 0)")
        check_random_size(cfg)  # before touching the output directory
        if out.exists() and not out.is_dir():
            raise ValueError(f"{out} exists and is not a directory")
        if out.is_dir() and any(out.iterdir()):
            if not args.force:
                raise ValueError(f"{out} is not empty (pass --force to replace it)")
            shutil.rmtree(out)
        storage_kinds(cfg, args.quantize, args.dspark)  # refuse a bad config before writing anything
        write_checkpoint(out, cfg, random_weights(cfg, args.seed, dspark=args.dspark), args.quantize)
    except (ConfigError, ValueError, OSError) as e:
        print(f"make_tiny: error: {e}", file=sys.stderr)
        return 2
    n = sum(math.prod(s) for s in param_specs.model_tensors(cfg, vision=cfg.has_vision,
                                                            dspark=args.dspark).values())
    print(f"wrote {out} ({n:,} parameters, quantize={args.quantize}, seed={args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
