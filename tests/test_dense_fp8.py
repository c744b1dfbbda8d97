"""fp8 dense weights held as stored (``ModelOptions.dense_format="fp8"``, docs/MODEL.md "Weight formats"): the
loader keeps the checkpoint's e4m3 codes and ue8m0 ``.scale`` bytes, the model's dense projections call the
block-scaled fp8 matmul op, and the result is the model of the same weights dequantised.

One checkpoint (tests/test_engine.py's 5-layer cut of the tiny config, every layer role) written with fp8 dense
matrices, loaded both ways.

Tolerances. (1) bf16 with the §C.2 rounding points, world 1: equal. The op's XLA implementation (the CPU path)
is the weight dequantised in the activations' dtype (exact: 4 significant bits times a power of two) and the
same dot with f32 accumulation the dequantised model's ``linear`` runs, so every product and sum is the same
operation on the same values. (2) f32 without rounding points (MODEL.md §C.4's tight comparison), world 4 against
world 1: atol 1e-4 on logits O(4), as tests/test_sharding_model.py — the only difference is the order of f32
sums (each rank's partial sums of wo_b, the shared expert and the experts all-reduced), ~1e-7 relative a sum,
amplified by the layers to a few 1e-6 (observed 3e-6); without rounding points no quantisation boundary
amplifies a last-bit change. Greedy tokens equal. (3) The Pallas kernel in the model: the same f32 bound.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_engine import mini_config
from test_sharding_model import mirror_config

import sharding
from dsv41_jax import planner
from dsv41_jax.checkpoint import CheckpointError, load_checkpoint, open_checkpoint
from dsv41_jax.config import load_named
from dsv41_jax.formats import fp8_dequantize
from dsv41_jax.loading import build_model, choose_dense_format
from dsv41_jax.make_tiny import random_weights, write_checkpoint
from dsv41_jax.model import ModelOptions, Transformer, init_cache
from dsv41_jax.param_specs import is_fp8_dense, layer_names, model_tensors, release_tensors
from sharding.load import checkpoint_source
from sharding.mesh import ShardingError

BATCH, PROMPT = 2, 48  # ≥ 48 tokens: the window evicts and the indexer selects (MODEL.md §A.3)
LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    cfg = mini_config()
    path = tmp_path_factory.mktemp("fp8-dense")
    write_checkpoint(path, cfg, random_weights(cfg, seed=0), "fp8")
    return cfg, path


def _prompt(cfg) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(1).integers(3, cfg.vocab_size, (BATCH, PROMPT)), jnp.int32)


def _logits(model, cfg, dtype: str, mesh=None) -> tuple[np.ndarray, str]:
    """Prefill logits [B, T, V] of the prompt and the compiled program's HLO text."""
    graphdef, state = nnx.split(model)
    cache = init_cache(cfg, BATCH, 64, dtype)
    run = lambda state, ids, cache: nnx.merge(graphdef, state)(ids, cache)[0]
    if mesh is None:
        program = jax.jit(run)
    else:
        rep = sharding.replicated(mesh)
        program = jax.jit(run, in_shardings=(sharding.state_sharding(model), rep, sharding.cache_sharding(mesh, cache)),
                          out_shardings=sharding.logits_sharding(mesh))
    compiled = program.lower(state, _prompt(cfg), cache).compile()
    return np.asarray(compiled(state, _prompt(cfg), cache)), compiled.as_text()


def _one_device(path, cfg, dtype: str, dense_format: str, **options):
    _, flat = load_checkpoint(path, cfg, dtype=dtype, progress=False, dense_format=dense_format)
    return build_model(cfg, ModelOptions(dtype=dtype, dense_format=dense_format, **options), flat)


def test_fp8_dense_bf16_model_equals_the_dequantized_model(fp8_checkpoint):
    cfg, path = fp8_checkpoint
    fp8 = _one_device(path, cfg, "bfloat16", "fp8")
    attn = fp8.layers[0].attn
    assert attn.wq_b.weight[...].dtype == jnp.float8_e4m3fn and attn.wq_b.scale[...].dtype == jnp.uint8
    assert attn.wq_b.scale[...].shape == (cfg.num_attention_heads * cfg.head_dim // 32, cfg.q_lora_rank // 32)
    want, _ = _logits(_one_device(path, cfg, "bfloat16", "dequantized"), cfg, "bfloat16")
    got, _ = _logits(fp8, cfg, "bfloat16")
    np.testing.assert_array_equal(got, want)


def test_fp8_dense_pallas_kernel_in_the_model(fp8_checkpoint):
    """The model's dense projections on the Pallas kernel (interpret mode on CPU; compiled on a GPU), f32 without
    rounding points: the kernel forms every product exactly (an f32 x as three exact bf16 pieces against the
    decoded weight) and sums in f32 in its own order, so only summation order differs from the dequantised
    model: the f32 bound of the world-4 test (observed 3e-6)."""
    cfg, path = fp8_checkpoint
    options = dict(quant_rounding=False)
    want, _ = _logits(_one_device(path, cfg, "float32", "dequantized", **options), cfg, "float32")
    got, _ = _logits(_one_device(path, cfg, "float32", "fp8", dense_impl="pallas", **options), cfg, "float32")
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_ATOL)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.devices(4)
def test_fp8_dense_world_4_matches_the_dequantized_model_on_one_device(fp8_checkpoint):
    """World 4: 4 heads, 2 groups and 64 shared-expert columns a rank, their scales split with them."""
    cfg, path = fp8_checkpoint
    options = dict(quant_rounding=False)
    want, _ = _logits(_one_device(path, cfg, "float32", "dequantized", **options), cfg, "float32")
    ckpt = open_checkpoint(path, cfg, dense_format="fp8")
    model, mesh = sharding.prepare(cfg, checkpoint_source(ckpt, "float32"), 4,
                                   ModelOptions(dtype="float32", dense_format="fp8", **options))
    wo_b = model.inner.layers[0].attn.wo_b
    assert {s.data.shape for s in wo_b.weight[...].addressable_shards} == {(cfg.hidden_size, 32)}
    assert {s.data.shape for s in wo_b.scale[...].addressable_shards} == {(cfg.hidden_size // 32, 1)}
    got, hlo = _logits(model, cfg, "float32", mesh)
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_ATOL)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    # MODEL.md §F.4 as for the dequantised model: an all-reduce after wo_b and after the MoE a layer, one for the
    # embedding; no weight (codes or scales) is ever gathered
    found = re.findall(r"= (\([^)]*\)|\S+) (all-reduce|all-gather|all-to-all|collective-permute)\(", hlo)
    assert Counter(op for _, op in found)["all-reduce"] == 2 * cfg.num_hidden_layers + 1, found
    assert all(shape.startswith("f32[") for shape, _ in found), found


@pytest.mark.devices(8)
def test_a_world_that_cuts_a_scale_block_is_refused(fp8_checkpoint):
    """World 8: wo_a's 128 rows (8 groups of 16) would be 16 a rank, half a 32-row scale block: refused by name
    before any tensor is read; the dequantised weights run at that world."""
    cfg, path = fp8_checkpoint
    ckpt = open_checkpoint(path, cfg, dense_format="fp8")
    with pytest.raises(ShardingError, match=r"world 8 cuts the fp8 scale blocks of layers\.0\.attn\.wo_a\.weight"):
        sharding.prepare(cfg, checkpoint_source(ckpt), 8, ModelOptions(dtype="float32", dense_format="fp8"))


@pytest.mark.devices(4)
@pytest.mark.parametrize("world", [1, 4])
def test_param_bytes_per_device_equal_planner(tmp_path_factory, world):
    """The planner's count of fp8 dense weights (a code byte a parameter plus the rank's ue8m0 bytes) is what the
    devices hold, padding included (bf16 model: the other weights 16-bit, f32 roles f32). tests/
    test_sharding_model.py's mirror config: the shared expert's 1,152 columns split unevenly (384/256/256/256 at
    world 4 in 384-wide shards), so its codes and scales carry padding, which is zero."""
    cfg = mirror_config()
    path = tmp_path_factory.mktemp("fp8-mirror")
    write_checkpoint(path, cfg, random_weights(cfg, seed=0), "fp8")
    ckpt = open_checkpoint(path, cfg, dense_format="fp8")
    model, mesh = sharding.prepare(cfg, checkpoint_source(ckpt, "bfloat16"), world,
                                   ModelOptions(dtype="bfloat16", dense_format="fp8"))
    held = sharding.param_bytes_per_device(model)
    for rank, device in enumerate(mesh.devices.flat):
        assert held[device.id] == planner.param_bytes_per_rank(cfg, world, rank, experts="bf16", dense="fp8")
    split = planner.admit(cfg, world).expert_split
    w2 = model.inner.layers[0].ffn.shared_experts.w2  # [D, F]: F split on the columns, its scales by 32
    stored = ckpt.read("layers.0.ffn.shared_experts.w2.scale")
    for rank, device in enumerate(mesh.devices.flat):
        lo, hi = split.real_range(rank)
        codes = np.asarray(next(s.data for s in w2.weight[...].addressable_shards if s.device == device))
        scale = np.asarray(next(s.data for s in w2.scale[...].addressable_shards if s.device == device))
        np.testing.assert_array_equal(scale[:, : (hi - lo) // 32], stored[:, lo // 32: hi // 32])
        assert not scale[:, (hi - lo) // 32:].any() and not codes.view(np.uint8)[:, hi - lo:].any()


@pytest.mark.parametrize("name", ["tiny", "tiny_engram"])
def test_model_parameters_are_the_fp8_inventory(name):
    """The model built with fp8 dense weights (DSpark stages and engram layers included) holds exactly the tensors
    ``model_tensors(dense_format="fp8")`` lists, codes and scales in their stored shapes; those are the release's
    fp8 matrices (``param_specs.is_fp8_dense`` agrees with the inventory's kinds)."""
    cfg = load_named(name)
    options = ModelOptions(dense_format="fp8", dspark=True)
    model = nnx.eval_shape(lambda: Transformer(cfg, options, rngs=nnx.Rngs(0)))
    held = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        layers = layer_names(".".join(map(str, path)))  # a stacked unit's tensor holds its layers' [n, ...]
        shape = tuple(var.shape)[1:] if len(layers) > 1 else tuple(var.shape)
        held.update({layer: (shape, var.dtype) for layer in layers})
    want = model_tensors(cfg, dspark=True, dense_format="fp8")
    assert {k: s for k, (s, _) in held.items()} == want
    fp8 = {s.name for s in release_tensors(cfg, dspark=True) if s.stored == "fp8"}
    assert {k for k in want if is_fp8_dense(k) and k.endswith(".weight")} == fp8
    for k, (_, dtype) in held.items():
        if is_fp8_dense(k):
            assert dtype == (jnp.float8_e4m3fn if k.endswith(".weight") else jnp.uint8), k


def test_checkpoint_without_fp8_dense_is_refused_by_name(tmp_path):
    cfg = mini_config()
    write_checkpoint(tmp_path, cfg, random_weights(cfg, seed=0), "none")
    with pytest.raises(CheckpointError, match=r"dense format fp8 needs .* tensor layers\.0\.attn\.wq_a\.weight"):
        open_checkpoint(tmp_path, cfg, dense_format="fp8")
    assert open_checkpoint(tmp_path, cfg).stored_dense_format == "dequantized"


def test_checkpoint_reads_fp8_dense_as_stored(fp8_checkpoint):
    """Codes and scale bytes as the writer stored them, whole or a rank's window; they decode to the dequantised
    read."""
    cfg, path = fp8_checkpoint
    ckpt = open_checkpoint(path, cfg, dense_format="fp8")
    assert ckpt.stored_dense_format == "fp8"
    name = "layers.1.attn.wq_b.weight"
    codes, scale = ckpt.read(name), ckpt.read(name.replace(".weight", ".scale"))
    assert codes.dtype == jnp.float8_e4m3fn and scale.dtype == np.uint8
    window = ckpt.read_window(name, (slice(256, 512),))
    np.testing.assert_array_equal(window.view(np.uint8), codes[256:512].view(np.uint8))
    dequantized = open_checkpoint(path, cfg).read(name)
    np.testing.assert_array_equal(fp8_dequantize(codes, scale), dequantized)


@pytest.mark.parametrize("requested,stored,want", [
    ("auto", "fp8", "dequantized"), ("auto", "dequantized", "dequantized"), ("bf16", "fp8", "dequantized"),
    ("fp8", "fp8", "fp8")])
def test_dense_format_choice(requested, stored, want):
    assert choose_dense_format(requested, stored) == want


def test_dense_format_fp8_needs_fp8_weights():
    with pytest.raises(ValueError, match="needs a checkpoint whose dense matrices are stored in fp8"):
        choose_dense_format("fp8", "dequantized")


def _generate_json(capsys, *argv) -> dict:
    from dsv41_jax import generate  # noqa: PLC0415 - the CLI module, only for these tests

    assert generate.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_dense_format_fp8_gives_the_dequantized_tokens(fp8_checkpoint, capsys):
    """The command line's --dense-format: fp8 holds the stored codes (said in the source line), bf16 and auto
    dequantise (fp8 is asked for, not chosen); greedy tokens are the same either way (the same values, bf16)."""
    _, path = fp8_checkpoint
    base = ["--checkpoint", str(path), "--prompt-ids", "3,4,5,6,7", "--max-new-tokens", "4", "--greedy"]
    fp8 = _generate_json(capsys, *base, "--dense-format", "fp8")
    auto = _generate_json(capsys, *base)
    assert "fp8 dense weights" in json.dumps(fp8) and "fp8 dense weights" not in json.dumps(auto)
    assert [r["generated_ids"] for r in fp8["results"]] == [r["generated_ids"] for r in auto["results"]]


def test_generate_dense_format_fp8_without_stored_fp8_is_one_line(tmp_path, capsys):
    from dsv41_jax import generate  # noqa: PLC0415 - the CLI module, only for these tests

    assert generate.main(["--config", "tiny", "--prompt-ids", "3,4", "--dense-format", "fp8"]) == 2
    assert "--dense-format fp8 needs --checkpoint" in capsys.readouterr().err
    cfg = mini_config()
    write_checkpoint(tmp_path, cfg, random_weights(cfg, seed=0), "none")
    assert generate.main(["--checkpoint", str(tmp_path), "--prompt-ids", "3,4", "--dense-format", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "stored in fp8" in err and "Traceback" not in err
