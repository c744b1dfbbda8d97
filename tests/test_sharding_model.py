"""The sharded model against one device: worlds 2, 4, 8 on the 8 simulated CPU devices (tests/conftest.py).

Reference: the plain ``Transformer`` with ``load_weights`` on one device (no sharding code involved).
Both configs run f32 with the §C.2 rounding points off (MODEL.md §C.4: the tight comparison).

Tolerance of the logits: atol 1e-4 on logits of size ~3. The only differences are the order of f32 sums:
per-rank partial sums of wo_b and of the experts are all-reduced, the vocabulary-parallel embedding is summed
over ranks; each reorders a sum of a few hundred terms (~1e-7 relative), amplified by the layers to a few 1e-6
(observed ≤ 6e-6 over the ten layers of the tiny config). Without rounding points there is no quantisation
boundary to amplify a last-bit change. Greedy tokens must be identical.

Greedy decoding is done by recomputation: one program per world over a fixed [B, 52] buffer from an empty
cache, ``lengths`` growing by one each step (rows ≥ length are padding, docs/DESIGN.md), so a single compile
gives both the prefill logits and the greedy tokens. The cached decode path is covered by the
``generate --world 4`` test.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import jax
import numpy as np
import pytest
from flax import nnx
from test_engine import mini_config

import sharding
from dsv41_jax import planner
from dsv41_jax.checkpoint import open_checkpoint
from dsv41_jax.config import load_named
from dsv41_jax.loading import load_weights
from dsv41_jax.make_tiny import random_weights, write_checkpoint
from dsv41_jax.model.cache import init_cache
from dsv41_jax.model.transformer import ModelOptions, Transformer
from sharding.load import checkpoint_source

OPTIONS = ModelOptions(dtype="float32", quant_rounding=False)
BATCH, PROMPT, NEW = 2, 48, 4  # ≥ 48 prompt tokens: the window evicts and the indexer selects (MODEL.md §A.3)
LOGITS_ATOL = 1e-4


def mirror_config():
    """Heads and groups per rank as the full model (16 heads, 2 groups a rank at world 4: 64 heads, 8 groups),
    small dims; expert width 9 and vocabulary 5 blocks of 128, so every world > 1 pads unevenly."""
    return load_named("tiny").replace(
        num_attention_heads=64, o_groups=8, head_dim=32, qk_rope_head_dim=16, o_lora_rank=16,
        vocab_size=640, moe_intermediate_size=1152, n_routed_experts=16, num_experts_per_tok=2,
        num_hidden_layers=4, compress_ratios=(0, 0, 2, 2), kv_source_layer_ids=(2,), index_source_layer_ids=(2,),
        candidate_source_layer_id=-1, num_nextn_predict_layers=0, dspark_target_layer_ids=())


# "mini": tests/test_engine.py's 5-layer cut of the tiny config, which keeps every layer role (window, full r=2,
# full r=1 as the candidate source, reindex, reuse): what is sharded and all-reduced is per role, so the ten
# layers of the whole tiny config add compile time (45 -> 25 s on CPU), not cases.
CONFIGS = {"mini": mini_config, "mirror": mirror_config}
_cache: dict = {}


def setup(name: str):
    """(cfg, weights, prompt ids, reference logits, reference greedy tokens), computed once per config."""
    if name not in _cache:
        cfg = CONFIGS[name]()
        flat = random_weights(cfg, seed=0)
        prompt = np.random.default_rng(1).integers(3, cfg.vocab_size, (BATCH, PROMPT)).astype(np.int32)
        model = Transformer(cfg, OPTIONS)
        load_weights(model, flat)
        logits, tokens, _ = greedy(model, cfg, prompt, None)
        _cache[name] = cfg, flat, prompt, logits, tokens
    return _cache[name]


def greedy(model, cfg, prompt, mesh, new: int = NEW, max_context: int = 64):
    """Prefill logits [B, P, V] of ``prompt`` [B, P] and ``new`` greedy tokens [B, new] (recomputed over a fixed
    buffer, one compiled program), plus that program's HLO text. ``mesh``: shardings of a sharded model."""
    batch, length0 = prompt.shape
    graphdef, state = nnx.split(model)
    cache = init_cache(cfg, batch=batch, max_context=max_context, dtype="float32")

    def run(state, ids, lengths, cache):
        return nnx.merge(graphdef, state)(ids, cache, lengths)[0]

    if mesh is None:
        program = jax.jit(run)
    else:
        rep = sharding.replicated(mesh)
        program = jax.jit(run, in_shardings=(sharding.state_sharding(model), rep, rep,
                                             sharding.cache_sharding(mesh, cache)),
                          out_shardings=sharding.logits_sharding(mesh))
    ids = np.zeros((batch, length0 + new), np.int32)
    ids[:, :length0] = prompt
    compiled = program.lower(state, ids, np.full(batch, length0, np.int32), cache).compile()
    first = None
    for step in range(new):
        length = length0 + step
        logits = np.asarray(compiled(state, ids, np.full(batch, length, np.int32), cache))
        first = logits[:, :length0] if first is None else first
        ids[:, length] = logits[:, length - 1].argmax(-1)
    return first, ids[:, length0:], compiled.as_text()


def collectives(hlo: str) -> list[tuple[str, str]]:
    """(op, result shape) of every collective in the compiled program (tuple results as one entry)."""
    pattern = r"= (\([^)]*\)|\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)\("
    return [(op, shape) for shape, op in re.findall(pattern, hlo)]


def assert_token_rows_reduced(found: list[tuple[str, str]], cfg) -> None:
    """Each all-reduce is one f32 array of the tokens' rows, [B, T, D] or [B·T, D]: the MoE's too (the XLA
    implementation runs inside the sharding wrapper's shard_map, as the kernel does; split by the partitioner it
    all-reduced a tuple of the routed pairs' [N·k, D] products and the shared expert's [N, D], and in the "ep"
    layout also the pairs' [N·k, F] gate and up halves)."""
    rows, d = BATCH * (PROMPT + NEW), cfg.hidden_size
    reduced = {shape.split("{")[0] for op, shape in found if op == "all-reduce"}
    assert reduced <= {f"f32[{BATCH},{PROMPT + NEW},{d}]", f"f32[{rows},{d}]"}, found


@pytest.mark.parametrize("name,world", [("mini", 2), ("mini", 4), ("mini", 8),
                                        ("mirror", 1), ("mirror", 2), ("mirror", 4), ("mirror", 8)])
@pytest.mark.devices
def test_sharded_prefill_and_greedy_match_one_device(name, world):
    cfg, flat, prompt, ref_logits, ref_tokens = setup(name)
    model, mesh = sharding.prepare(cfg, flat, world, OPTIONS)
    logits, tokens, hlo = greedy(model, cfg, prompt, mesh)
    assert logits.shape == ref_logits.shape  # the real vocabulary: padded logits never reach the sampler
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGITS_ATOL)
    np.testing.assert_array_equal(tokens, ref_tokens)
    # MODEL.md §F.4: one all-reduce after wo_b and one after the MoE per layer, one for the vocabulary-parallel
    # embedding; the only other data movement is the logits' gather (f32[B, T, ·]): no weight is ever gathered.
    found = collectives(hlo)
    if world == 1:
        assert not found, found
        return
    assert Counter(op for op, _ in found)["all-reduce"] == 2 * cfg.num_hidden_layers + 1, found
    assert_token_rows_reduced(found, cfg)
    moved = [shape for op, shape in found if op != "all-reduce"]
    assert moved and all(shape.startswith(f"f32[{BATCH},{PROMPT + NEW},") for shape in moved), found


@pytest.mark.parametrize("world", [4])  # uneven head, group and vocabulary splits; world 2 is the same mechanism
@pytest.mark.devices
def test_row_parallel_segment_matches_one_device(world):
    """The planner's row-parallel segments (``PlanOptions.row_parallel_rows``, issue #22): each rank mixes,
    collapses, normalises and expands its own rows; the result is world 1's. The data movement says the split
    happened: the sublayer inputs [B, T, D] are all-gathered (two a layer), on top of §F.4's all-reduces."""
    cfg, flat, prompt, ref_logits, ref_tokens = setup("mirror")
    tiles = planner.kernel_tiles(cfg, world, planner.PlanOptions(row_parallel_rows=16))
    model, mesh = sharding.prepare(cfg, flat, world, dataclasses.replace(OPTIONS, tiles=tiles))
    logits, tokens, hlo = greedy(model, cfg, prompt, mesh)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGITS_ATOL)
    np.testing.assert_array_equal(tokens, ref_tokens)
    gathers = [shape for op, shape in collectives(hlo)
               if op == "all-gather" and shape.startswith(f"f32[{BATCH},{PROMPT + NEW},{cfg.hidden_size}]")]
    assert len(gathers) >= 2 * cfg.num_hidden_layers, collectives(hlo)


@pytest.mark.devices(4)
def test_expert_parallel_layout_matches_one_device():
    cfg, flat, prompt, ref_logits, ref_tokens = setup("mirror")
    model, mesh = sharding.prepare(cfg, flat, 4, OPTIONS, layout="ep")
    assert model.run_cfg.moe_intermediate_size == cfg.moe_intermediate_size  # whole experts: no F padding
    w1 = model.inner.layers[0].ffn.experts.w1.weight[...]
    assert {s.data.shape for s in w1.addressable_shards} == {(4, 1152, cfg.hidden_size)}  # 16 experts / 4
    logits, tokens, hlo = greedy(model, cfg, prompt, mesh)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGITS_ATOL)
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert_token_rows_reduced(collectives(hlo), cfg)


@pytest.mark.devices
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_param_bytes_per_device_equal_planner(world):
    cfg = mirror_config()
    model, mesh = sharding.prepare(cfg, random_weights(cfg, seed=0), world, OPTIONS)
    held = sharding.param_bytes_per_device(model)
    for rank, device in enumerate(mesh.devices.flat):
        assert held[device.id] == planner.param_bytes_per_rank(cfg, world, rank, experts="f32", dense="f32",
                                                               padded=True)


@pytest.mark.devices(4)
def test_padding_is_zero_and_real_shards_are_the_checkpoint_slices():
    """World 4 of the mirror config: expert width 384/256/256/256 in 384-wide shards, vocab 256/128/128/128."""
    cfg = mirror_config()
    flat = random_weights(cfg, seed=0)
    model, mesh = sharding.prepare(cfg, flat, 4, OPTIONS)
    adm = planner.admit(cfg, 4)
    w2 = model.inner.layers[1].ffn.experts.w2.weight[...]   # [E, D, F_pad], F split on the last axis
    embed = model.inner.embed.weight[...]                   # [V_pad, D], rows split
    for rank, device in enumerate(mesh.devices.flat):
        lo, hi = adm.expert_split.real_range(rank)
        shard = np.asarray(next(s.data for s in w2.addressable_shards if s.device == device))
        np.testing.assert_array_equal(shard[..., : hi - lo], flat["layers.1.ffn.experts.w2.weight"][..., lo:hi])
        assert not shard[..., hi - lo:].any()
        lo, hi = adm.vocab_split.real_range(rank)
        shard = np.asarray(next(s.data for s in embed.addressable_shards if s.device == device))
        np.testing.assert_array_equal(shard[: hi - lo], flat["embed.weight"][lo:hi])
        assert not shard[hi - lo:].any()


@pytest.mark.parametrize("world", [3, 16])
def test_world_not_admitted_is_refused_with_the_planner_message(world):
    cfg = load_named("tiny")
    with pytest.raises(planner.PlanRefused) as expected:
        planner.admit(cfg, world)
    with pytest.raises(planner.PlanRefused) as refused:
        sharding.prepare(cfg, random_weights(cfg, seed=0), world, OPTIONS)
    assert str(refused.value) == str(expected.value) and refused.value.rule == expected.value.rule


@pytest.mark.devices(4)
@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_checkpoint_decodes_straight_into_shards(tmp_path, layout):
    """A tiny fp8/fp4 checkpoint read lazily at world 4: every shard holds exactly the stored values."""
    cfg = load_named("tiny")
    stored = write_checkpoint(tmp_path, cfg, random_weights(cfg, seed=0), "fp4")  # float32 values as stored
    ckpt = open_checkpoint(tmp_path)
    expert_reads: Counter = Counter()
    read = ckpt.read

    def counted(name, **kwargs):
        if kwargs.get("experts") is not None:
            expert_reads[name] += len(kwargs["experts"])
        return read(name, **kwargs)

    ckpt.read = counted
    model, mesh = sharding.prepare(cfg, checkpoint_source(ckpt), 4, OPTIONS, layout=layout)
    plan = model.plan
    for path, var in nnx.to_flat_state(nnx.state(model.inner, nnx.Param)):
        name = ".".join(map(str, path))
        value = np.asarray(var[...])
        hit = sharding.rules.split_axis(name, value.ndim, layout)
        if hit is not None:
            value = np.take(value, plan.split(hit[1], value.shape[hit[0]]).real_index(), axis=hit[0])
        np.testing.assert_array_equal(value, stored[name], err_msg=name)
    # Routed experts are decoded one expert at a time; with whole experts a rank each is decoded exactly once.
    per_tensor = cfg.n_routed_experts * (1 if layout == "ep" else 4)
    assert set(expert_reads.values()) == {per_tensor} and len(expert_reads) == 3 * cfg.num_hidden_layers


@pytest.mark.devices(2)
def test_prepare_gives_the_model_the_planners_kernel_tiles():
    """Issue #13: the sharded model's options carry the plan's kernel tiles for its world (planner.kernel_tiles:
    R4's head tile for 8 heads a rank, §E's BM); tiles given explicitly are kept."""
    cfg = load_named("tiny")
    model, _ = sharding.prepare(cfg, random_weights(cfg, seed=0), 2, OPTIONS)
    tiles = model.inner.options.tiles
    assert tiles == planner.kernel_tiles(cfg, 2)
    assert (tiles.attention_head_tile, tiles.moe_block_m) == (cfg.num_attention_heads // 2, 64)
    mine = planner.KernelTiles(4, 4, 32, 1 << 20)
    model, _ = sharding.prepare(cfg, random_weights(cfg, seed=0), 2, ModelOptions(dtype="float32", tiles=mine))
    assert model.inner.options.tiles == mine
