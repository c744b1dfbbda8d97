"""The planner's vision tower (VISION.md §V.G): buckets, per-rank weights and workspace, R10's vision terms and
the `plan` CLI's vision section.

Independent references: the tensor shapes of `param_specs.vision_tensors` (VISION.md §V.F) with the split
written out by hand; the bytes JAX actually holds on each device of a sharded TINY-V model; XLA's memory analysis
of the compiled tower (the planner's workspace is an upper bound of its temporaries).
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np
import pytest
from flax import nnx
from PIL import Image

import sharding
from dsv41_jax import planner
from dsv41_jax.config import load_named
from dsv41_jax.loading import build_model
from dsv41_jax.make_tiny import random_weights
from dsv41_jax.model.transformer import ModelOptions
from dsv41_jax.param_specs import vision_tensors
from dsv41_jax.plan import main as plan_main
from dsv41_jax.runtime import ENCODE, FlatState
from dsv41_jax.vision.batch import build_batch
from dsv41_jax.vision.preprocess import prepare_image

FULL, TINY_V = load_named("dsv41_flash"), load_named("tiny_vision")


def test_release_buckets_and_largest_image():
    vc = FULL.vision
    assert planner.patch_buckets(vc) == (64, 128, 256, 512, 1024, 2048, 4096, 8192, 9216)
    assert planner.token_buckets(vc) == (16, 32, 64, 128, 256, 512, 1024)
    assert planner.max_patches(vc) == 9189  # 9 · 1,021 (VISION.md §V.B.7)
    for n in (1, 64, 65, 1000, 4097, 8192, 8193, 9189):
        assert planner.patch_bucket(n, vc) == min(9216, max(64, 1 << (n - 1).bit_length()))
    assert planner.token_bucket(1021, vc) == 1024 and planner.token_bucket(3, vc) == 16
    with pytest.raises(planner.PlanRefused, match="exceeds the largest bucket"):
        planner.patch_bucket(9217, vc)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_release_vision_weights_from_the_tensor_shapes(world):
    """16 heads of 64 and 2,816 MLP columns split evenly at every world; the aligner's 5,120 columns too."""
    vc, D = FULL.vision, FULL.hidden_size
    C, F, W = vc.hidden_size, vc.intermediate_size, world
    block = (3 * C // W) * C + 3 * C // W + C * (C // W) + C + (2 * F // W) * C + C * (F // W) + 2 * C
    rest = C * vc.patch_dim + C + C + (D // W) * 9 * C + D // W + D * (D // W) + D + 3 * D
    want = 2 * (vc.num_hidden_layers * block + rest) + 4 * FULL.num_hidden_layers * FULL.n_routed_experts
    assert planner.vision_param_bytes_per_rank(FULL, world, 0) == want
    if world == 1:  # every image-path tensor of §V.F, whole
        assert want == sum((4 if s.stored == "f32" else 2) * math.prod(s.shape) for s in vision_tensors(FULL))


@pytest.mark.devices
@pytest.mark.parametrize("world", [1, 2, 4])
def test_vision_weights_equal_what_each_device_holds(world):
    """TINY-V (2 heads, so world 4 pads two zero heads): the planner's padded bytes = the sharded model's."""
    model, mesh = sharding.prepare(TINY_V, random_weights(TINY_V, seed=0), world,
                                   ModelOptions(dtype="float32", quant_rounding=False, vision=True))
    names = {s.name for s in vision_tensors(TINY_V)}
    held: dict[int, int] = {}
    for path, var in nnx.to_flat_state(nnx.state(model.inner, nnx.Param)):
        if ".".join(map(str, path)) in names:
            for shard in var[...].addressable_shards:
                held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    for rank, device in enumerate(mesh.devices.flat):
        assert held[device.id] == planner.vision_param_bytes_per_rank(TINY_V, world, rank, dense="f32")
    real = [planner.vision_param_bytes_per_rank(TINY_V, world, r, dense="f32", padded=False) for r in range(world)]
    assert (len(set(real)) > 1) == (world == 4)  # uneven only where the heads are padded


def test_r10_counts_the_tower_with_images():
    options, budget = planner.PlanOptions(images=True, experts="fp4", dense="fp8"), planner.MemoryBudget()
    terms = planner.memory_need(FULL, 4, 0, options, budget)
    plan = planner.plan_vision(FULL, 4, 0, options)
    assert terms["vision_weights"] == plan.weight_bytes == planner.vision_param_bytes_per_rank(FULL, 4, 0)
    assert terms["vision_workspace"] == plan.workspace_total > 0
    text = planner.memory_need(FULL, 4, 0, planner.PlanOptions(experts="fp4", dense="fp8"), budget)
    assert text["vision_weights"] == text["vision_workspace"] == 0
    two = planner.plan_vision(FULL, 4, 0, planner.PlanOptions(images=True, vision_images=2))
    ws, ws2 = dict(plan.workspace), dict(two.workspace)
    assert ws2["v.rows"] == 2 * ws["v.rows"] == 2 * 1024 * FULL.hidden_size * 2  # B · M · D bf16
    assert ws2["v.stacked"] == ws["v.stacked"]  # the weights' copy does not grow with the images


# TINY-V, and TINY-V with room for 230 image tokens: 2,048 patches, attention in two query chunks (lax.map).
TOWERS = {"one_chunk": TINY_V,
          "two_chunks": dataclasses.replace(TINY_V, vision=dataclasses.replace(TINY_V.vision, max_image_tokens=230))}


@pytest.mark.parametrize("tower", TOWERS)
def test_workspace_bounds_xla_temporaries(tower):
    """The tower compiled for one image at the largest bucket (1,024 or 2,048 patches): XLA's temporaries fit the
    planner's workspace. Observed: one chunk, CPU 17.8 MB of 57.7 (the [2, 1,024, 1,024] f32 scores dominate),
    H200 44.5 MB (the scores beside a 32 MiB cuBLAS workspace, ``v.gemm``); two chunks, CPU 37.3 MB of 82.1,
    H200 55.6 MB (one chunk's scores live at a time)."""

    cfg = TOWERS[tower]
    assert planner.patch_buckets(cfg.vision)[-1] == {"one_chunk": 1024, "two_chunks": 2048}[tower]
    options = ModelOptions(dtype="float32", quant_rounding=False, vision=True)
    model = build_model(cfg, options, random_weights(cfg, seed=0))
    image = prepare_image(Image.new("RGB", (800, 800), (9, 99, 200)), cfg.vision)
    batch = build_batch([image], cfg.vision, n_bucket=planner.patch_buckets(cfg.vision)[-1],
                        m_bucket=planner.token_buckets(cfg.vision)[-1])
    graphdef, state = nnx.split(model)
    compiled = jax.jit(lambda s, b: ENCODE.fn(graphdef, s, b)).lower(FlatState.of(state), batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    plan = planner.plan_vision(cfg, 1, 0, planner.PlanOptions(images=True, dense="f32"))
    print(f"{tower}: XLA temporaries {temp:,} B, planned {plan.workspace_total:,} B {dict(plan.workspace)}")
    assert 0 < temp <= plan.workspace_total, (temp, plan.workspace_total)


def test_plan_cli_shows_the_vision_tower(capsys):
    args = ["--config", "dsv41_flash", "--world", "4", "--rows", "2048", "--position", "0", "--images",
            "--vision-images", "2"]
    assert plan_main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    vision = out["vision"]
    assert vision["patch_buckets"][-1] == 9216 and vision["token_buckets"][-1] == 1024 and vision["images"] == 2
    assert (vision["heads_per_rank"], vision["mlp_per_rank"]) == (4, 704)
    assert vision["weight_bytes"] == planner.vision_param_bytes_per_rank(FULL, 4, 0, dense="fp8")
    assert out["total_bytes_with_vision"] == out["total_bytes"] + vision["weight_bytes"] + vision["workspace_total"]
    assert plan_main(args) == 0
    table = capsys.readouterr().out
    assert "vision weights" in table and "9,216" in table and "total with the vision tower" in table
    assert plan_main([a for a in args if a != "--images"] + ["--json"]) == 0  # no --images: no vision section
    assert "vision" not in json.loads(capsys.readouterr().out)
    np.testing.assert_equal(vision["workspace_total"], sum(vision["workspace_bytes"].values()))
