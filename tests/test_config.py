"""Config loading and validation (MODEL.md §A, §B.9): roles against the spec's tables, clear refusals."""

import json
from pathlib import Path

import pytest

from dsv41_jax import config
from dsv41_jax.config import CONFIG_DIR, ConfigError, ModelConfig, load_named, yarn_inv_freq


def test_tiny_roles_match_spec_table():
    # MODEL.md §A.3: 0,1 window · 2 full · 3 reuse · 4 full · 5 reuse · 6 full+candidate · 7 reuse ·
    # 8 reindex (keys of 6, candidate-masked) · 9 reuse (top-k of 8).
    cfg = load_named("tiny")
    assert [cfg.role(i) for i in range(10)] == [
        "window", "window", "full", "reuse", "full", "reuse", "full", "reuse", "reindex", "reuse"]
    assert [cfg.kv_source(i) for i in range(2, 10)] == [2, 2, 4, 4, 6, 6, 6, 6]
    assert [cfg.index_source(i) for i in range(2, 10)] == [2, 2, 4, 4, 6, 6, 8, 8]
    assert cfg.index_key_source(8) == 6
    assert [i for i in range(10) if cfg.uses_candidates(i)] == [8]


def test_full_roles_match_spec_table():
    # MODEL.md §A.2.
    cfg = load_named("dsv41_flash")
    assert cfg.hidden_size == 5120 and cfg.num_hidden_layers == 40 and cfg.vocab_size == 129280
    roles = [cfg.role(i) for i in range(40)]
    assert roles[:2] == ["window", "window"]
    assert [i for i, r in enumerate(roles) if r == "full"] == [2, 8, 14, 20]
    assert [i for i, r in enumerate(roles) if r == "reindex"] == [24, 28, 32, 36]
    assert cfg.index_source(25) == 24 and cfg.kv_source(25) == 20 and cfg.index_key_source(24) == 20
    assert [i for i in range(40) if cfg.uses_candidates(i)] == [24, 28, 32, 36]
    assert cfg.quantization["expert_dtype"] == "fp4"
    assert len(cfg.unsupported_features()) == 1  # DSpark (engram and images run)


def test_yarn_frequencies_match_spec():
    # MODEL.md §B.5: full config pairs 0-15 plain, 16-24 divided by 1.1034 ... 6.4, 25-31 by 16.
    cfg = load_named("dsv41_flash")
    f = yarn_inv_freq(cfg, 1)
    ratios = [160000 ** (-2 * i / 64) / f[i] for i in range(32)]
    assert all(abs(r - 1) < 1e-12 for r in ratios[:16])
    assert abs(ratios[16] - 1.1034) < 1e-4 and abs(ratios[24] - 6.4) < 1e-9
    assert all(abs(r - 16) < 1e-9 for r in ratios[25:])
    tiny = load_named("tiny")  # §A.3: pairs 0-2 plain, 3-4 blended, 5-7 divided by 16
    t = [160000 ** (-2 * i / 16) / v for i, v in enumerate(yarn_inv_freq(tiny, 2))]
    assert all(abs(r - 1) < 1e-12 for r in t[:3]) and 1 < t[3] < t[4] < 16
    assert all(abs(r - 16) < 1e-9 for r in t[5:])
    assert yarn_inv_freq(tiny, 0)[1] == pytest.approx(10000 ** (-2 / 16))


def test_flat_and_nested_give_same_config():
    nested = load_named("dsv41_flash")
    with open(CONFIG_DIR / "dsv41_flash.json") as f:
        raw = json.load(f)
    flat = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    flat.update(raw["text_config"], model_type="deepseek_v41")
    assert ModelConfig.from_dict(flat).replace(vision=nested.vision) == nested
    again = ModelConfig.from_dict(load_named("tiny").to_dict())
    assert again == load_named("tiny")


@pytest.mark.parametrize("change, message", [
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"o_groups": 5}, "not divisible by o_groups"),
    ({"kv_source_layer_ids": [1, 2, 4, 6]}, "kv source layer 1 has compress ratio 0"),
    ({"compress_ratios": [0, 0, 2]}, "compress_ratios has 3 entries"),
    ({"index_source_layer_ids": [2, 6, 8]}, "takes its top-k from layer 2"),
    ({"candidate_source_layer_id": 8}, "candidate_source_layer_id 8"),
    ({"model_type": "llama"}, "not DeepSeek-V4.1"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling type"),
])
def test_bad_configs_are_refused_with_a_reason(change, message):
    raw = {**load_named("tiny").to_dict(), **change}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no config file"):
        ModelConfig.from_json(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path)


def test_named_configs_come_from_the_package():
    """Issue 12 #2: names resolve inside the installed package (importlib.resources), the same files as the
    repository's top-level configs/; an unknown name is one clear error listing the known ones."""

    assert {"tiny", "dsv41_flash"} <= set(config.config_names())
    top = Path(__file__).resolve().parent.parent / "configs"
    assert (config.CONFIG_DIR / "tiny.json").read_text() == (top / "tiny.json").read_text()
    with pytest.raises(ConfigError, match="no config named 'tiyn' .known: .*tiny"):
        load_named("tiyn")


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": "ten"}, 'num_hidden_layers: "ten" is a string, wanted an integer'),
    ({"num_hidden_layers": True}, "num_hidden_layers: true is a boolean, wanted an integer"),  # bool is an int
    ({"hidden_size": 64.0}, "hidden_size: 64.0 is a number, wanted an integer"),
    ({"norm_topk_prob": 1}, "norm_topk_prob: 1 is an integer, wanted true or false"),
    ({"rope_theta": "1e4"}, 'rope_theta: "1e4" is a string, wanted a finite number'),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps: NaN is not a finite number, wanted a finite number"),
    ({"scoring_func": None}, "scoring_func is null, wanted a string"),
    ({"compress_ratios": [0, "2"]}, 'compress_ratios\\[1\\]: "2" is a string, wanted an integer'),
    ({"compress_ratios": 2}, "compress_ratios: 2 is an integer, wanted a list of integers"),
    ({"eos_token_id": [1, None]}, "eos_token_id\\[1\\] is null, wanted an integer"),
    ({"eos_token_id": "1"}, 'eos_token_id: "1" is a string, wanted an integer or a list of integers'),
    ({"image_token_id": 5.5}, "image_token_id: 5.5 is a number, wanted an integer or null"),
    ({"rope_scaling": {"factor": "16"}}, 'rope_scaling.factor: "16" is a string, wanted a finite number'),
    ({"rope_scaling": 16}, "rope_scaling: 16 is an integer, wanted an object or null"),
    ({"quantization_config": "fp8"}, 'quantization_config: "fp8" is a string, wanted an object or null'),
    ({"quantization_config": {"quant_method": 8}}, "quantization_config.quant_method: 8 is an integer, wanted a"),
    ({"vision_config": {"hidden_size": "64"}}, 'vision_config.hidden_size: "64" is a string, wanted an integer'),
    ({"vision_config": [1]}, "vision_config: \\[1\\] is a list, wanted an object"),
    ({"text_config": []}, None),  # empty: the flat fields stand
    ({"text_config": 3}, "text_config: 3 is an integer, wanted an object"),
    ({"o_groups": 0}, "o_groups must be at least 1, got 0"),
    ({"vocab_size": -1}, "vocab_size must be at least 1, got -1"),
])
def test_field_types_are_checked_where_the_config_is_read(change, message):
    raw = {**load_named("tiny").to_dict(), **change}
    if message is None:
        assert ModelConfig.from_dict(raw) == load_named("tiny")
        return
    with pytest.raises(ConfigError, match=f"^{message}"):
        ModelConfig.from_dict(raw)


def test_every_shipped_config_loads_and_keeps_its_types(tmp_path):
    """configs/*.json (the release's own config among them) load; optional fields may be null, a number field may
    be written as an integer, and the file's name prefixes a refusal."""
    for path in sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.json")):
        cfg = ModelConfig.from_json(path)
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg, path
    flash = load_named("dsv41_flash")
    assert flash.rope_scaling.factor == 16.0 and isinstance(flash.rope_scaling.factor, float)
    assert flash.vision is not None and flash.vision.max_wh_ratio is None
    assert flash.quantization["expert_dtype"] == "fp4"
    raw = {**load_named("tiny").to_dict(), "image_token_id": None, "rope_theta": 10000, "quantization_config": None}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.image_token_id is None and cfg.rope_theta == 10000 and cfg.quantization is None
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**raw, "hidden_size": "64"}))
    with pytest.raises(ConfigError, match=f'^{bad}: hidden_size: "64" is a string, wanted an integer$'):
        load_named(str(tmp_path))
    bad.write_bytes(b"\xff{}")
    with pytest.raises(ConfigError, match=f"^config file {bad} is not UTF-8 text: byte 0 \\(line 1\\) is 0xff"):
        ModelConfig.from_json(bad)
