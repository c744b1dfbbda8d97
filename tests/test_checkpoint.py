"""Checkpoint inventory, tiny writer → loader round trips, refusals, the CLI and the mlx-lm oracle harness."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).parent))  # tests/ has no __init__.py: make mlx_oracle importable

from dsv41_jax import checkpoint, generate, make_tiny, param_specs, runspec
from dsv41_jax.checkpoint import CheckpointError, load_checkpoint, open_checkpoint
from dsv41_jax.config import load_named

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cfg():
    return load_named("tiny")


@pytest.fixture(scope="module")
def weights(cfg):
    return make_tiny.random_weights(cfg, seed=3)


@pytest.fixture(scope="module")
def written(tmp_path_factory, cfg, weights):
    """One checkpoint per quantize mode: {mode: (dir, values as stored)}."""
    root = tmp_path_factory.mktemp("ckpts")
    return {q: (root / q, make_tiny.write_checkpoint(root / q, cfg, weights, q)) for q in make_tiny.QUANTIZE_MODES}


# ------------------------------------------------------------------------------------------------ inventory
def test_inventory_matches_spec_counts_and_roles(cfg):
    shapes = param_specs.model_tensors(cfg)
    # MODEL.md §A.3: mlx-lm builds TINY with 5,299,500 parameters (no engram / DSpark).
    assert sum(math.prod(s) for s in shapes.values()) == 5_299_500
    layers_with = lambda suffix: sorted(int(n.split(".")[1]) for n in shapes if n.endswith(suffix))
    # §A.3 roles: 2, 4, 6 full (6 ratio 1: no gate), 8 reindex, others window / reuse.
    assert layers_with("compressor.wkv.weight") == [2, 4, 6]
    assert layers_with("compressor.wgate.weight") == [2, 4]
    assert layers_with("indexer.wk.weight") == layers_with("indexer.k_norm.weight") == [2, 4, 6]
    assert layers_with("indexer.wq_b.weight") == layers_with("indexer.weights_proj.weight") == [2, 4, 6, 8]
    assert shapes["layers.5.ffn.experts.w1.weight"] == (8, 256, 64)
    assert shapes["layers.5.ffn.experts.w2.weight"] == (8, 64, 256)
    official = param_specs.expected_tensors(cfg, quantized=True)
    assert official["layers.5.ffn.experts.7.w2.weight"] == param_specs.TensorSpec(
        "layers.5.ffn.experts.7.w2.weight", (64, 128), "fp4")
    assert official["layers.5.ffn.experts.7.w2.scale"].shape == (64, 8)
    assert official["layers.5.attn.wq_b.scale"].shape == (32, 1)
    assert "layers.5.attn.wq_b.scale" not in param_specs.expected_tensors(cfg, quantized=False)
    # §A.3: ≈ 4 MB with fp8 dense and fp4 experts.
    assert 3.5e6 < sum(s.nbytes for s in official.values()) < 4.5e6
    assert param_specs.skip_reason("mtp.0.attn.wq_a.weight")
    assert param_specs.skip_reason("layers.1.engram.wkv.weight")
    assert param_specs.skip_reason("layers.3.ffn.gate.bias_vl")
    assert not param_specs.skip_reason("layers.3.ffn.gate.bias")


def test_random_weights_seeded_and_on_the_storage_grid(cfg, weights):
    again = make_tiny.random_weights(cfg, seed=3)
    other = make_tiny.random_weights(cfg, seed=4)
    assert all(np.array_equal(weights[k], again[k]) for k in weights)
    assert not np.array_equal(weights["embed.weight"], other["embed.weight"])
    for name, w in weights.items():
        assert w.dtype == np.float32 and w.shape == param_specs.model_tensors(cfg)[name]
        if param_specs.model_dtype_kind(name) != "f32":  # bf16-stored: values must survive a bf16 round trip
            np.testing.assert_array_equal(w.astype(ml_dtypes.bfloat16).astype(np.float32), w)


# ------------------------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("mode", make_tiny.QUANTIZE_MODES)
def test_write_then_load_gives_the_stored_values(cfg, weights, written, mode):
    path, stored = written[mode]
    loaded_cfg, flat = load_checkpoint(path, progress=False)
    assert loaded_cfg == cfg
    assert set(flat) == set(param_specs.model_tensors(cfg))
    for name, value in flat.items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, stored[name], err_msg=name)
    quant = json.loads((path / "config.json").read_text()).get("quantization_config")
    assert (quant is None) == (mode == "none")
    # Against the float weights: exact where stored plain (random_weights puts them on the bf16 grid);
    # otherwise within the format's rounding. e4m3: half an ulp of 3 mantissa bits = 2^-4 relative (plus a
    # tiny absolute term for subnormals). e2m1: the group scale s = 2^⌈log2(amax/6)⌉ < amax/3 and the widest
    # level gap is 2 (4 → 6), so the error is at most s < amax/3 of the 32-wide group.
    for name, w in weights.items():
        dense_fp8 = mode != "none" and name.endswith(("wq_a.weight", "attn.wq_b.weight", "wkv.weight",
                                                      "wo_a.weight", "wo_b.weight", "indexer.wq_b.weight",
                                                      "shared_experts.w1.weight", "shared_experts.w2.weight",
                                                      "shared_experts.w3.weight")) and "compressor" not in name
        expert_fp4 = mode == "fp4" and ".experts.w" in name
        if expert_fp4:
            groups = w.reshape(*w.shape[:-1], -1, 32)
            err = np.abs(stored[name] - w).reshape(groups.shape)
            assert np.all(err <= np.abs(groups).max(-1, keepdims=True) / 3), name
        elif dense_fp8:
            assert np.all(np.abs(stored[name] - w) <= np.abs(w) * 2.0 ** -4 + 2.0 ** -16), name
        else:
            np.testing.assert_array_equal(stored[name], w, err_msg=name)


def test_bfloat16_load_keeps_the_f32_parameters(written):
    path, stored = written["fp4"]
    _, flat = load_checkpoint(path, dtype="bfloat16", progress=False)
    assert flat["layers.0.hc_attn_fn"].dtype == np.float32
    assert flat["layers.2.attn.compressor.wkv.weight"].dtype == np.float32
    assert flat["layers.2.ffn.gate.bias"].dtype == np.float32
    assert flat["layers.2.attn.wq_a.weight"].dtype == ml_dtypes.bfloat16
    for name, value in flat.items():  # every dequantised value is exact in bf16 (§E.1)
        np.testing.assert_array_equal(value.astype(np.float32), stored[name], err_msg=name)


def test_iter_and_read_one_tensor_or_some_experts(written):
    path, stored = written["fp4"]
    ckpt = open_checkpoint(path)
    names = [n for n, _ in checkpoint.iter_tensors(path, progress=False)]
    assert names == list(param_specs.model_tensors(ckpt.cfg))
    part = ckpt.read("layers.4.ffn.experts.w2.weight", experts=[1, 6])
    np.testing.assert_array_equal(part, stored["layers.4.ffn.experts.w2.weight"][[1, 6]])
    part = ckpt.read("layers.4.ffn.experts.w3.weight", experts=slice(2, 5))
    np.testing.assert_array_equal(part, stored["layers.4.ffn.experts.w3.weight"][2:5])
    # The only parts left out: the router's image bias (written like the release); DSpark is in the config.
    assert any("bias_vl" in line for line in ckpt.skipped) and any("DSpark" in line for line in ckpt.skipped)


# ------------------------------------------------------------------------------------------------- refusals
def _copy_and_edit(src: Path, dst: Path, edit) -> Path:
    """Copy a checkpoint into one ``model.safetensors`` after ``edit(tensors)`` (a dict of stored arrays)."""
    files = checkpoint._Files()
    tensors = {}
    for shard in sorted(src.glob("model-*.safetensors")):
        for name, t in checkpoint.read_header(shard).items():
            tensors[name] = np.array(files.array(t))
    edit(tensors)
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _refused(path, *words):
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, progress=False)
    for w in words:
        assert w in str(info.value), str(info.value)
    return str(info.value)


def test_single_file_checkpoint_loads(written, tmp_path):
    src, stored = written["fp4"]
    path = _copy_and_edit(src, tmp_path / "single", lambda t: None)
    _, flat = load_checkpoint(path, progress=False)
    assert all(np.array_equal(flat[k], stored[k]) for k in stored)


@pytest.mark.parametrize("edit,words", [
    (lambda t: t.pop("layers.3.attn.wkv.weight"), ["missing tensor", "layers.3.attn.wkv.weight"]),
    (lambda t: t.pop("layers.0.attn.wq_a.scale"), ["missing tensor", "layers.0.attn.wq_a.scale"]),
    (lambda t: t.pop("layers.5.ffn.experts.7.w2.weight"), ["missing tensor", "layers.5.ffn.experts.7.w2.weight"]),
    (lambda t: t.update({"layers.3.attn.bogus.weight": np.zeros(4, np.float32)}),
     ["unexpected tensor", "layers.3.attn.bogus.weight"]),
    # a ratio-1 layer has no compressor gate; a reuse layer has no indexer (§A.3 roles)
    (lambda t: t.update({"layers.6.attn.compressor.wgate.weight": np.zeros((64, 64), np.float32)}),
     ["unexpected tensor", "layers.6.attn.compressor.wgate.weight"]),
    (lambda t: t.update({"layers.3.attn.indexer.wq_b.weight": np.zeros((128, 32), np.float32)}),
     ["unexpected tensor", "layers.3.attn.indexer.wq_b.weight"]),
    (lambda t: t.update({"layers.2.attn.compressor.wgate.weight": np.zeros((64, 32), np.float32)}),
     ["layers.2.attn.compressor.wgate.weight", "[64, 32]", "[64, 64]"]),
    (lambda t: t.update({"layers.1.ffn.experts.0.w1.weight": np.zeros((256, 16), np.int8)}),
     ["layers.1.ffn.experts.0.w1.weight", "[256, 16]", "[256, 32]"]),
    (lambda t: t.update({"layers.1.attn.wo_b.scale": np.zeros((2, 2), np.uint8)}),
     ["layers.1.attn.wo_b.scale", "[2, 4]"]),
    (lambda t: t.update({"norm.weight": np.zeros(64, np.int32)}), ["norm.weight", "I32"]),
])
def test_refuses_bad_tensors_by_name(written, tmp_path, edit, words):
    _refused(_copy_and_edit(written["fp4"][0], tmp_path / "bad", edit), *words)


def test_skips_dspark_engram_and_vision_and_says_so(written, tmp_path):
    extra = {"mtp.0.attn.wq_a.weight": np.zeros((32, 64), np.float32),
             "layers.1.engram.wkv.weight": np.zeros((8, 8), np.float32),
             "vision.norm.weight": np.zeros(8, np.float32)}
    path = _copy_and_edit(written["none"][0], tmp_path / "extra", lambda t: t.update(extra))
    text = " ".join(open_checkpoint(path).skipped)
    assert "DSpark" in text and "engram" in text and "vision" in text
    _, flat = load_checkpoint(path, progress=False)
    assert not any(k.startswith(("mtp.", "vision.")) or "engram" in k for k in flat)


def test_refuses_missing_dir_config_files_and_other_models(written, tmp_path):
    _refused(tmp_path / "nowhere", "does not exist")
    src = written["none"][0]
    no_config = tmp_path / "no_config"
    shutil.copytree(src, no_config)
    (no_config / "config.json").unlink()
    _refused(no_config, "config.json")
    other = tmp_path / "llama"
    shutil.copytree(src, other)
    raw = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**raw, "model_type": "llama"}))
    _refused(other, "model_type", "llama")
    lost_shard = tmp_path / "lost_shard"
    shutil.copytree(src, lost_shard)
    shard = sorted(set(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (lost_shard / shard).unlink()
    _refused(lost_shard, shard, "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(src / "config.json", empty / "config.json")
    _refused(empty, "model.safetensors")


# ------------------------------------------------------------------------------------------------------ CLI
def test_cli_writes_and_refuses(tmp_path, capsys):
    out = tmp_path / "cli"
    assert make_tiny.main([str(out), "--seed", "5", "--quantize", "fp8"]) == 0
    cfg, flat = load_checkpoint(out, progress=False)
    assert cfg.quantization["quant_method"] == "fp8"
    assert make_tiny.main([str(out)]) == 2  # not empty
    assert "not empty" in capsys.readouterr().err
    assert make_tiny.main([str(tmp_path / "x"), "--config", str(tmp_path / "missing.json")]) == 2
    bad = tmp_path / "odd.json"  # hidden size 48: fp8 blocks of 32 do not tile wq_a's inputs
    bad.write_text(json.dumps({**json.loads((REPO / "configs/tiny.json").read_text()), "hidden_size": 48}))
    assert make_tiny.main([str(tmp_path / "odd"), "--config", str(bad), "--quantize", "fp4"]) == 2
    assert "multiple of 32" in capsys.readouterr().err
    assert not (tmp_path / "odd").exists()
    # A real process: argparse's exit code 2 and a one-line usage error, no traceback.
    proc = subprocess.run([sys.executable, "-m", "dsv41_jax.make_tiny", str(tmp_path / "y"), "--quantize", "int3"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "invalid choice" in proc.stderr


# ---------------------------------------------------------------------------------------------- mlx oracle
mlx_oracle = pytest.importorskip("mlx_oracle")
needs_mlx = pytest.mark.skipif(not mlx_oracle.HAVE_MLX, reason="mlx-lm (test extra) is not installed")


@needs_mlx
def test_mlx_dequantises_like_our_loader(written):
    """mlx-lm's own mxfp8 / mxfp4 kernels read the same numbers from the files (independent codec check)."""
    import mlx.core as mx  # noqa: PLC0415 - the test extra, absent on the GPU machine (needs_mlx)

    path, stored = written["fp4"]
    model = mlx_oracle.load_mlx_model(path)
    layer = model.model.layers[4]
    for module, name in [(layer.mlp.experts.switch_mlp.down_proj, "layers.4.ffn.experts.w2.weight"),
                         (layer.self_attn.q_b_proj, "layers.4.attn.wq_b.weight"),
                         (layer.mlp.shared_experts.up_proj, "layers.4.ffn.shared_experts.w3.weight")]:
        deq = mx.dequantize(module.weight, module.scales, None, group_size=32, bits=module.bits, mode=module.mode)
        np.testing.assert_array_equal(np.array(deq.astype(mx.float32)), stored[name], err_msg=name)


@needs_mlx
def test_mlx_reference_runs_on_a_tiny_checkpoint(written):
    path, _ = written["fp4"]
    ids = np.random.default_rng(0).integers(3, 512, 20).tolist()
    ref = mlx_oracle.mlx_reference(path, ids, decode_steps=3)
    assert ref["prefill"].shape == (20, 512) and ref["decode"].shape == (3, 512)
    assert np.isfinite(ref["prefill"]).all() and np.isfinite(ref["decode"]).all()
    # Sane activations through all 10 layers: logits O(1), neither collapsed nor exploding.
    assert 0.2 < ref["prefill"].std() < 5
    assert ref["tokens"][0] == np.argmax(ref["prefill"][-1])
    assert ref["tokens"][1] == np.argmax(ref["decode"][0])
    # Chunked prefill with the rounding points off equals one pass up to f32 summation order (§D.4: 2.6e-6
    # observed; 1e-4 leaves room for other BLAS orders), and turning rounding off changes the logits.
    off = mlx_oracle.mlx_reference(path, ids, decode_steps=1, quant_rounding=False)
    off_chunked = mlx_oracle.mlx_reference(path, ids, decode_steps=1, quant_rounding=False, chunks=[7, 13])
    np.testing.assert_allclose(off_chunked["prefill"], off["prefill"], atol=1e-4)
    assert np.abs(off["prefill"] - ref["prefill"]).max() > 1e-3
    assert mlx_oracle.deepseek_v41._fake_quant_fp8.__name__ == "_fake_quant_fp8"  # patch undone


@needs_mlx
def test_mlx_reference_bfloat16_with_plain_experts(written):
    path, _ = written["none"]
    ids = list(range(3, 15))
    # Rounding points off: with them on, a bf16-vs-f32 difference moves fp4 values across whole steps (§C.4).
    bf = mlx_oracle.mlx_reference(path, ids, decode_steps=1, dtype="bfloat16", quant_rounding=False)
    f32 = mlx_oracle.mlx_reference(path, ids, decode_steps=1, dtype="float32", quant_rounding=False)
    assert np.isfinite(bf["prefill"]).all()
    # bf16 keeps 8 significant bits (2^-9 relative a rounding); dozens of roundings over 10 layers put O(1)
    # logits about 1e-2 apart, while an expert-routing flip can move a single position further: bound the
    # mean, and require a difference (the bf16 path really ran in bf16).
    diff = np.abs(bf["prefill"] - f32["prefill"])
    assert 0 < diff.mean() < 0.05


def test_stored_expert_format_and_generate_auto(written, capsys):
    """--expert-format auto holds experts fp4 exactly when the checkpoint stores them fp4 (make_tiny: "fp4" is
    the release's layout, "fp8" / "none" store experts as fp8 / bf16)."""
    expected = {"none": "dequantized", "fp8": "dequantized", "fp4": "fp4"}
    for mode, fmt in expected.items():
        assert open_checkpoint(written[mode][0]).stored_expert_format == fmt
        args = generate.build_parser().parse_args(["--checkpoint", str(written[mode][0]), "--prompt", "x"])
        inputs = runspec.open_checkpoint_inputs(generate.run_spec(args))
        assert inputs.expert_format == fmt and inputs.description.endswith("fp4 experts") == (fmt == "fp4")
        assert all(not hasattr(w, "__array__") for w in inputs.weights.values())  # lazily read, nothing yet
    args = generate.build_parser().parse_args(["--checkpoint", str(written["fp8"][0]), "--prompt", "x",
                                               "--expert-format", "fp4"])
    with pytest.raises(CheckpointError, match="packed fp4"):
        runspec.open_checkpoint_inputs(generate.run_spec(args))
