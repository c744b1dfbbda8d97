"""The static planner against PLANNER.md's own numbers (§B-1..B-4, §C, §F) and the issue's cases.

Every expected value below is written from the spec's tables or from its formulas evaluated by hand here, never
captured from the planner's output.
"""

import subprocess
import sys

import pytest

from dsv41_jax.config import load_named
from dsv41_jax.planner import (
    DECODE_HEAD_TILE,
    MOE_TILE,
    MemoryBudget,
    PlanOptions,
    PlanRefused,
    activation_row_bytes,
    admit,
    buffer_plan,
    check_memory,
    kernel_tiles,
    kv_bytes,
    max_context,
    param_bytes_per_rank,
    plan_decode_window,
    plan_segment,
    planned_only,
    segment_sizes,
    window_bytes,
)

MiB, GiB = 1 << 20, 1 << 30
FULL = load_named("dsv41_flash")
TINY = load_named("tiny")
LIMIT = 1_048_576
K, D = 6, 5120
FOUR_K = PlanOptions(pf4k=True, acknowledge_4k=True)


def test_planner_and_cli_import_no_jax():
    """The planner, and the CLI modules, which check their arguments and set XLA's flags before JAX starts."""
    code = ("import sys, dsv41_jax.planner, dsv41_jax.plan, dsv41_jax.cli, dsv41_jax.runspec, dsv41_jax.generate, "
            "dsv41_jax.profile, dsv41_jax.serve.__main__; "
            "bad = [m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------------------- §B-1 and §C
B1 = {  # W: (H_l, G_l, BMQ, grid, I_r per rank, V_r per rank, zb floats, decode z MiB)
    1: (64, 8, 32, 2, [2304], [129280], 132_120_576, 504),
    2: (32, 4, 32, 1, [1152] * 2, [64640] * 2, 66_060_288, 252),
    4: (16, 2, 16, 1, [640, 640, 512, 512], [32384, 32384, 32256, 32256], 36_700_160, 140),
    8: (8, 1, 8, 1, [384] * 2 + [256] * 6, [16256] * 2 + [16128] * 6, 36_700_160, 140),
}


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_per_world_constants_b1(world):
    h_l, g_l, bmq, grid, widths, vocab, zb, z_mib = B1[world]
    adm = admit(FULL, world)
    assert (adm.heads_per_rank, adm.groups_per_rank, adm.head_tile, adm.attention_grid) == (h_l, g_l, bmq, grid)
    assert list(adm.expert_widths) == widths and list(adm.vocab_rows) == vocab
    for rank in range(world):
        plan = plan_segment(FULL, world, rank, 16, 0)
        assert plan.moe_bound_floats == zb
        assert plan.workspace_bytes["L.moe.z"] == z_mib * MiB  # decode z = 4·zb bytes at 16 rows
        if world >= 4:
            assert plan.workspace_bytes["L.moe.xg"] == 70 * MiB  # "decode xg holds R_e·7·D halves = 70 MiB"


def test_split_tables_and_padded_layout():
    # MODEL.md §F.2 / §F.3 (128-aligned blocks).
    assert admit(FULL, 2).expert_widths == (1152, 1152)
    assert admit(FULL, 8).vocab_rows == (16256,) * 2 + (16128,) * 6
    adm = admit(FULL, 4)
    assert adm.expert_width_padded == 640 and adm.vocab_padded == 32384
    assert adm.expert_split.padded_total == 4 * 640
    assert [adm.expert_columns(r) for r in range(4)] == [(0, 640), (640, 1280), (1280, 1792), (1920, 2432)]
    assert adm.expert_split.real_range(2) == (1280, 1792) and adm.expert_split.real_range(3) == (1792, 2304)
    index = adm.expert_split.padded_index()
    assert len(index) == 2560 and [i for i in index if i >= 0] == list(range(2304))
    assert index[1792:1920] == [-1] * 128  # rank 2's padding: 128 columns after its 512 real ones
    assert adm.vocab_slice(3) == (3 * 32384, 3 * 32384 + 32256)


def test_uneven_split_off_refuses_with_way_out():
    # §C first refusal example.
    with pytest.raises(PlanRefused) as e:
        admit(FULL, 4, uneven=False)
    assert e.value.rule == "admission"
    assert "18 blocks of 128" in e.value.message and "640/640/512/512" in e.value.message
    assert admit(FULL, 2, uneven=False).expert_widths == (1152, 1152)


@pytest.mark.parametrize("world", [3, 16])
def test_worlds_that_cut_a_group_refuse(world):
    with pytest.raises(PlanRefused) as e:
        admit(FULL, world)
    assert e.value.rule == "R4"


# ------------------------------------------------------------------------------------------ the cases
@pytest.mark.parametrize("rank", [0, 1, 2, 3])
@pytest.mark.parametrize("rows", [1024, 2048, 17, 16])
@pytest.mark.parametrize("position", [0, 300_000])
def test_world4_every_rank_plans(rank, rows, position):
    plan = plan_segment(FULL, 4, rank, rows, position)
    assert plan.expert_width == (640, 640, 512, 512)[rank]
    assert (plan.head_tile, plan.attention_grid, plan.output_groups) == (16, 1, 2)
    assert plan.moe_strategy == "whole" and plan.moe_blocks == 1
    pairs = rows * K
    assert plan.moe_block_rows == pairs
    assert plan.workspace_bytes["L.moe.z"] >= 4 * pairs * D  # R5′
    assert plan.workspace_bytes["L.moe.xg"] >= 2 * pairs * plan.expert_width
    assert plan.short == (rows <= 16)


def test_world4_2048_rows_is_one_block_of_12288():
    for rank in range(4):
        plan = plan_segment(FULL, 4, rank, 2048, 300_000)
        assert (plan.moe_blocks, plan.moe_block_rows) == (1, 12_288)
        assert plan.workspace_bytes["L.moe.z"] == 251_658_240  # "z 240 MiB" (B-2): 4·12,288·5,120


@pytest.mark.parametrize("rows", [1024, 2048])
def test_staged_replay_ring(rows):
    # §A staging ring ceil_pow2(prefill_rows + 127); B-2 ring column.
    off = plan_segment(FULL, 4, 0, rows, 300_000, PlanOptions(replay=True))
    on = plan_segment(FULL, 4, 0, rows, 300_000, PlanOptions(replay=True, pf4k=True, acknowledge_4k=True))
    assert off.staged and on.staged
    assert (off.ring_rows, on.ring_rows) == (4096, 8192)
    assert off.replay.decoder_start == 20 and off.replay.tail_rows == 127


@pytest.mark.parametrize("rows", [16, 17])
def test_short_replay_segments_use_the_slot_ring(rows):
    plan = plan_segment(FULL, 4, 0, rows, 0, PlanOptions(replay=True))
    assert not plan.staged and plan.ring_rows == 256


def test_world2_refuses_4096_without_4k_and_plans_2048():
    with pytest.raises(PlanRefused) as e:
        plan_segment(FULL, 2, 0, 4096, 0)
    assert e.value.rule == "R1"
    plan = plan_segment(FULL, 2, 1, 2048, 0)
    # B.3: world 2 keeps R5: 62,914,560 ≤ 66,060,288 and 14,155,776 ≤ 36,700,160.
    assert plan.moe_strategy == "bounded" and plan.moe_blocks == 1
    assert 2048 * K * D == 62_914_560 <= plan.moe_bound_floats
    assert plan_segment(FULL, 2, 0, 4096, 0, FOUR_K).moe_strategy == "whole"


@pytest.mark.parametrize("rows", [16, 17, 1024, 2048])
def test_images_at_world4(rows):
    for rank in range(4):
        plan = plan_segment(FULL, 4, rank, rows, 300_000, PlanOptions(images=True))
        assert plan.image_rows == -1 and plan.image_keep  # the full model has Engram layers


# ----------------------------------------------------------------------------------------------- full grid
ROWS = [16, 17, 32, 127, 128, 129, 130, 1024, 2047, 2048, 4096, 8192]


def _expected(world, n, start, four_k):
    """The verdict from R1 and R2 alone (§B.3, B-2), or the accepted plan's MoE shape."""
    cap = 4096 if four_k else 2048
    if n > cap:
        return "R1"
    if start + n > LIMIT:
        return "R2"
    strategy = "bounded" if world <= 2 and not four_k else "whole"
    ring = 256 if n <= 129 else (8192 if four_k else 4096)
    return strategy, ring


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("four_k", [False, True])
def test_full_grid(world, four_k):
    options = FOUR_K if four_k else PlanOptions()
    for n in ROWS:
        for start in sorted({0, 300_000, 1_000_000, LIMIT - n, LIMIT - n + 1, LIMIT}):
            want = _expected(world, n, start, four_k)
            if isinstance(want, str):
                with pytest.raises(PlanRefused) as e:
                    plan_segment(FULL, world, world - 1, n, start, options)
                assert e.value.rule == want, (n, start, e.value)
                if n == 8192:
                    assert "4 × 2,048 or 2 × 4,096" in e.value.message
                continue
            plan = plan_segment(FULL, world, world - 1, n, start, options)
            assert (plan.moe_strategy, plan.ring_rows) == want
            assert plan.moe_blocks == 1 and plan.moe_block_rows == n * K
            assert plan.head_tile == min(32, 64 // world)
            assert plan.router_launches == -(-n // 2048)


# ------------------------------------------------------------------------------------------ §C refusals, R5
def test_bounded_block_at_world4_refuses_with_spec_message():
    # §C third example.
    with pytest.raises(PlanRefused) as e:
        plan_segment(FULL, 4, 2, 2048, 300_000, PlanOptions(moe="bounded"))
    m = e.value.message
    assert e.value.rule == "R5"
    for part in ("W = 4, rank 2, n = 2,048, start 300,000", "12,288 pairs", "251,658,240 B", "146,800,640 B",
                 "+100 MiB", "1,024-row segments"):
        assert part in m, (part, m)


def test_halving_option():
    # B-2 note: halving gives 2 blocks of 1,024 rows at W ≥ 4 (31,457,280 ≤ 36,700,160), 4 blocks at 4,096.
    plan = plan_segment(FULL, 4, 0, 2048, 0, PlanOptions(moe="halving"))
    assert (plan.moe_blocks, plan.moe_block_tokens, plan.moe_block_rows) == (2, 1024, 6144)
    assert plan.workspace_bytes["L.moe.z"] == 140 * MiB  # stays decode-sized
    plan = plan_segment(FULL, 8, 0, 4096, 0, PlanOptions(moe="halving", pf4k=True, acknowledge_4k=True))
    assert plan.moe_blocks == 4


def test_fp8_experts_at_world4_refuse_r10():
    # §C second example; §F table: fp8 experts 140.8 GiB at W = 4, fp4 74.7 GiB.
    with pytest.raises(PlanRefused) as e:
        plan_segment(FULL, 4, 2, 2048, 0, PlanOptions(experts="fp8", dense="fp8"), MemoryBudget())
    m = e.value.message
    assert e.value.rule == "R10"
    for part in ("rank 0", "140.8 GiB", "640 of 2,304 columns", "fp4 experts (74.7 GiB)", "world 8"):
        assert part in m, (part, m)


@pytest.mark.parametrize("world,experts,fits", [
    (1, "fp4", False), (2, "fp4", False), (4, "fp4", True), (4, "fp8", False), (8, "fp4", True),
    (8, "fp8", True), (8, "bf16", False)])
def test_fits_table_f(world, experts, fits):
    # §F "fits 139 GiB (fp8 dense)" column.
    options = PlanOptions(experts=experts, dense="fp8")
    if fits:
        check_memory(FULL, world, options, MemoryBudget())
        assert max_context(FULL, world, MemoryBudget(), options) == LIMIT  # §F: 1 M fits in every feasible row
    else:
        with pytest.raises(PlanRefused, match="R10"):
            check_memory(FULL, world, options, MemoryBudget())


@pytest.mark.parametrize("world,bf16,fp8,fp4", [
    (1, 1012.5, 506.7, 268.9), (2, 506.2, 253.4, 134.5), (4, 281.2, 140.8, 74.7), (8, 168.8, 84.5, 44.8)])
def test_expert_bytes_table_f(world, bf16, fp8, fp4):
    # §F table, rounded there to 0.1 GiB: tolerance 0.06 GiB covers its rounding.
    for fmt, want in (("bf16", bf16), ("fp8", fp8), ("fp4", fp4)):
        got = param_bytes_per_rank(FULL, world, 0, experts=fmt, split="experts") / GiB
        assert abs(got - want) <= 0.06, (fmt, got, want)


def test_dense_bytes_fp8_world4():
    # §C message: "2.8 GiB dense" at W = 4 with fp8 dense (the §F table's 2.9 also counts Engram's projection,
    # which the text model does not hold yet): tolerance 0.15 GiB.
    got = param_bytes_per_rank(FULL, 4, 0, dense="fp8", split="dense") / GiB
    assert abs(got - 2.85) <= 0.15


def test_fp8_dense_bytes_world4_by_hand():
    """fp8 dense weights as the model holds them (docs/PLANNER.md §F): a code byte a parameter plus one ue8m0 byte
    per 32×32 block of the rank's shard. Rank 0 of world 4, written out from MODEL.md §E.2's shapes: every layer's
    wq_a [1280, 5120], wq_b [8192, 1280], wkv [512, 5120], wo_a [2048, 4096], wo_b [5120, 2048] and the shared
    expert's w1, w3 [640, 5120] (the widest shard) and w2 [5120, 640]; the 8 index layers' wq_b [4096, 1280]."""
    def fp8(n, k):
        return n * k + -(-n // 32) * -(-k // 32)

    layer = (fp8(1280, 5120) + fp8(8192, 1280) + fp8(512, 5120) + fp8(2048, 4096) + fp8(5120, 2048)
             + 2 * fp8(640, 5120) + fp8(5120, 640))
    want = 40 * layer + 8 * fp8(4096, 1280)
    bf16_params = (40 * (1280 * 5120 + 8192 * 1280 + 512 * 5120 + 2048 * 4096 + 5120 * 2048 + 3 * 640 * 5120)
                   + 8 * 4096 * 1280)  # the same tensors in bf16: 2 B a parameter (every other tensor is equal)
    got = param_bytes_per_rank(FULL, 4, 0, dense="fp8", split="dense") - param_bytes_per_rank(
        FULL, 4, 0, dense="bf16", split="dense")
    assert got == want - 2 * bf16_params


def test_fp8_dense_k_split_workspace():
    """``L.fp8_splits``: the fp8 kernel's f32 partial sums of a decode-sized call, the largest projection's. World
    4, the 17-row program (32-row blocks): wq_b [8192, 1280] is 128 programs of 64 rows with K in 5 steps of 256,
    split 5 ways to make a wave of 132 multiprocessors: 5 × 32 × 8,192 × 4 B; none without fp8 dense weights."""
    assert buffer_plan(FULL, 4, 0, PlanOptions(experts="fp4", dense="fp8")).bytes["L.fp8_splits"] == 5 * 32 * 8192 * 4
    assert buffer_plan(FULL, 4, 0, PlanOptions(experts="fp4", dense="bf16")).bytes["L.fp8_splits"] == 0


def test_fp8_dense_weights_are_not_planned_only():
    """fp8 dense weights run (the model's dense_format fp8); fp8 routed experts are still planned only."""
    assert "fp8_weights" not in planned_only(PlanOptions(experts="fp4", dense="fp8"))
    assert "fp8_weights" in planned_only(PlanOptions(experts="fp8", dense="fp8"))


# ---------------------------------------------------------------------------------------------- §B-3 paths
def _paths(start, n, budget_mib):
    plan = plan_segment(FULL, 4, 0, n, start, PlanOptions(index_budget=budget_mib * MiB))
    return {p.layer: p for p in plan.index_paths}


def test_index_paths_b3_start0():
    for budget in (256, 64):
        p = _paths(0, 2048, budget)
        assert p[2].kind == "materialised" and p[2].rows_per_launch == 2048
        assert p[2].scratch_bytes == 2048 * 1024 * 12  # "25 MB"
        assert p[20].kind == "materialised" and p[20].rows_per_launch == 2048
        assert p[20].scratch_bytes == 2048 * 2048 * 13  # "55 MB"
        assert p[24].kind == "rescoring" and p[24].rows_per_launch == {256: 1024, 64: 256}[budget]


def test_index_paths_b3_300k_and_1m():
    p = _paths(300_000, 2048, 256)
    assert (p[8].kind, p[8].rows_per_launch, p[8].splits) == ("streamed", 2048, 10)
    assert round(p[8].scratch_bytes / 1e6) == 168
    assert (p[20].rows_per_launch, round(p[20].scratch_bytes / 1e6)) == (74, 291)
    assert (_paths(300_000, 2048, 64)[20].rows_per_launch, round(_paths(300_000, 2048, 64)[20].scratch_bytes / 1e6)) \
        == (18, 71)
    p = _paths(1_000_000, 2048, 256)
    assert (p[14].rows_per_launch, p[14].splits) == (1057, 31) and p[14].scratch_bytes <= 256 * MiB
    assert (p[20].rows_per_launch, round(p[20].scratch_bytes / 1e6)) == (22, 287)
    assert (_paths(1_000_000, 2048, 64)[20].rows_per_launch, round(_paths(1_000_000, 2048, 64)[20].scratch_bytes
                                                                       / 1e6)) == (16, 208)


def test_index_paths_b3_short_at_1m():
    p = _paths(1_000_000, 16, 256)
    assert (p[2].kind, round(p[2].scratch_bytes / 1e6)) == ("small_window", 32)
    assert (p[20].kind, round(p[20].scratch_bytes / 1e6)) == ("small_window", 64)
    assert p[28].kind == "rescoring" and p[28].rows_per_launch == 16
    p = _paths(1_000_000, 16, 64)
    assert (p[2].kind, p[2].rows_per_launch, round(p[2].scratch_bytes / 1e6)) == ("materialised", 16, 96)
    assert (p[20].kind, round(p[20].scratch_bytes / 1e6)) == ("materialised", 208)


# ------------------------------------------------------------------------------------------- §F, §B-4 sizes
def test_kv_per_token_f():
    tokens = 1 << 20
    assert kv_bytes(FULL, tokens) == 1790 * tokens
    assert kv_bytes(FULL, tokens, options=PlanOptions(kv="bf16")) == 2890 * tokens
    assert kv_bytes(FULL, tokens, options=PlanOptions(index_keys="fp4")) == (1460 + 170) * tokens
    assert kv_bytes(FULL, tokens, 4, PlanOptions(split_kv=True)) == 695 * tokens
    assert window_bytes(FULL) == 43 * 256 * 584 + 3 * 2 * 512 * 4  # 6.43 MB + 12 KiB


@pytest.mark.parametrize("world,per_row", [(1, 523_736), (2, 456_664), (4, 454_616), (8, 515_032)])
def test_activation_row_bytes_b4(world, per_row):
    assert activation_row_bytes(FULL, world, max(admit(FULL, world).expert_widths)) == per_row


def test_4k_workspace_b2_deltas():
    # B-2: 4,096 rows in 4K mode: W = 4 z 480 MiB (+340 over decode); W = 1 xg grows to 108 MiB, z stays 504.
    assert plan_segment(FULL, 4, 0, 4096, 0, FOUR_K).workspace_bytes["L.moe.z"] == (140 + 340) * MiB
    w1 = plan_segment(FULL, 1, 0, 4096, 0, FOUR_K).workspace_bytes
    assert w1["L.moe.z"] == 504 * MiB and w1["L.moe.xg"] == 108 * MiB


def test_buffer_plan_is_role_max():
    bp = buffer_plan(FULL, 4, 0)
    assert ("whole", 16, 0) in bp.programs and ("whole", 2048, LIMIT - 2048) in bp.programs
    last = plan_segment(FULL, 4, 0, 2048, LIMIT - 2048)
    for role, size in last.workspace:
        assert bp.bytes[role] >= size
    assert bp.bytes["L.moe.z"] == 251_658_240
    replay = buffer_plan(FULL, 4, 0, PlanOptions(replay=True))
    assert ("decoder", 127, LIMIT - 128) in replay.programs and replay.bytes["s.ced_stash"] > 0
    four_k = buffer_plan(FULL, 4, 0, FOUR_K)
    assert four_k.bytes == bp.bytes and four_k.total_4k > bp.total


# --------------------------------------------------------------------------------------- other rules, sizes
def test_segment_sizes():
    assert segment_sizes(FULL, 4, 5000, 0) == [2048, 2048, 904]
    assert segment_sizes(FULL, 4, 5000, 0, FOUR_K) == [4096, 904]
    assert segment_sizes(FULL, 4, 4096, 100) == [2048, 2048]
    with pytest.raises(PlanRefused, match="R2"):
        segment_sizes(FULL, 4, 10, LIMIT - 5)
    # R6: a 4K workspace that does not fit above the floor falls back to 2K segments, never an error.
    tight = MemoryBudget(floor_4k_bytes=60 * GiB)
    fp4 = PlanOptions(pf4k=True, acknowledge_4k=True, experts="fp4", dense="fp8")
    assert segment_sizes(FULL, 4, 5000, 0, fp4, tight) == [2048, 2048, 904]
    assert segment_sizes(FULL, 4, 5000, 0, fp4, MemoryBudget()) == [4096, 904]


def test_option_rules():
    with pytest.raises(PlanRefused, match="R6"):
        plan_segment(FULL, 4, 0, 2048, 0, PlanOptions(pf4k=True))  # no acknowledgement
    with pytest.raises(PlanRefused, match="R6"):
        plan_segment(FULL, 4, 0, 2048, 0, PlanOptions(pf4k=True, acknowledge_4k=True, prefill_rows=2048))
    with pytest.raises(PlanRefused, match="R8"):
        plan_segment(FULL, 4, 0, 128, 0, PlanOptions(replay=True, part="decoder"))
    assert plan_segment(FULL, 4, 0, 127, 0, PlanOptions(replay=True, part="decoder")).index_paths[0].layer == 20
    with pytest.raises(PlanRefused, match="R7"):
        plan_segment(FULL, 4, 0, 1040, 0, PlanOptions(spans=(1024, 16)))
    assert plan_segment(FULL, 4, 0, 1041, 0, PlanOptions(spans=(1024, 17))).spans == (1024, 17)
    with pytest.raises(PlanRefused, match="R9"):
        plan_segment(FULL, 4, 0, 1000, 0, PlanOptions(tbo=True))
    plan_segment(FULL, 4, 0, 2048, 0, PlanOptions(tbo=True))


# --------------------------------------------------------------------------------------------- tiny model
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_tiny_every_world(world):
    # MODEL.md §A.3: 16 heads (2 a rank at world 8), experts 256 / 128 / 64 / 32 a rank.
    adm = admit(TINY, world)
    assert adm.expert_widths == (256 // world,) * world and adm.vocab_rows == (512 // world,) * world
    assert adm.head_tile == min(32, 16 // world) and adm.groups_per_rank == 8 // world
    limit = TINY.max_position_embeddings
    for rank in range(world):
        for n in (1, 16, 17, 48, 2048):
            for start in (0, limit - n):
                plan = plan_segment(TINY, world, rank, n, start, PlanOptions(images=True))
                assert plan.moe_block_rows == n * 2 and plan.image_rows == -1
        plan_segment(TINY, world, rank, 48, 0, PlanOptions(replay=True))


def test_tiny_param_bytes():
    # MODEL.md §A.3: 5,299,500 parameters. Split tensors per layer from §E.2 shapes at tiny sizes:
    # wq_b 1024·32, wo_a 128·128, wo_b 64·128, attn_sink 16, experts 3·8·256·64, shared 3·256·64;
    # embed and head 2·512·64.
    total = 5_299_500
    split = 10 * (1024 * 32 + 128 * 128 + 64 * 128 + 16 + 3 * 8 * 256 * 64 + 3 * 256 * 64) + 2 * 512 * 64
    for world in (1, 2, 4, 8):
        want = 4 * (total - split + split // world)
        for rank in range(world):
            assert param_bytes_per_rank(TINY, world, rank, experts="f32", dense="f32") == want


def test_padded_bytes_count_the_padding():
    # W = 4: rank 2 owns 512 real columns but its padded shard is 640 wide.
    real = param_bytes_per_rank(FULL, 4, 2, split="experts", padded=False)
    padded = param_bytes_per_rank(FULL, 4, 2, split="experts", padded=True)
    assert real == 40 * 384 * 3 * 512 * D * 2 and padded == 40 * 384 * 3 * 640 * D * 2


# ------------------------------------------------------------------------------------ decode windows, §G
def test_decode_windows_b3a():
    # §B.3a: head tile 16 clamped by R4 (W = 8 → 8); P = m·(k+1); small-window top-k while m ≤ 64 and
    # m·nvis·12 ≤ B_idx.
    w = plan_decode_window(FULL, 8, 3, 24, 100_000)
    assert (w.head_tile, w.attention_grid, w.moe_pairs, w.row_path) == (8, 1, 24 * 7, False)
    assert plan_decode_window(FULL, 1, 0, 6, 0).head_tile == 16 and plan_decode_window(FULL, 1, 0, 6, 0).row_path
    kinds = {p.layer: p.kind for p in plan_decode_window(FULL, 4, 0, 64, 100_000).index_paths}
    assert kinds[2] == "small_window" and kinds[20] == "small_window"  # 64·100,064·12 = 76.8 MB ≤ 256 MiB
    kinds = {p.layer: p.kind for p in plan_decode_window(FULL, 4, 0, 64, 1_000_000).index_paths}
    assert kinds[20] == "materialised"  # 64·1,000,064·12 = 768 MB > 256 MiB
    with pytest.raises(PlanRefused, match="R5"):
        plan_decode_window(FULL, 4, 0, 1025, 0)
    with pytest.raises(PlanRefused, match="R2"):
        plan_decode_window(FULL, 4, 0, 8, LIMIT - 4)


@pytest.mark.parametrize("world,gb", [(1, 0.0), (4, 5.0), (8, 11.8)])
def test_exchange_bytes_g(world, gb):
    # §G open question 1: 80·(W−1)·n·D·2 B a rank per 2,048-row segment: 5.0 GB at W = 4, 11.8 GB at W = 8.
    # Tolerance 0.1 GB: the formula gives 11.74 GB at W = 8, which the spec rounds to 11.8.
    assert abs(plan_segment(FULL, world, 0, 2048, 0).exchange_bytes / 1e9 - gb) <= 0.1


def test_budget_kv_pool_and_decoder_part_with_budget():
    options = PlanOptions(experts="fp4", dense="fp8", replay=True, part="decoder")
    # §F: W = 4 with fp4 experts leaves ~54 GiB of KV room, ≈ 32 M tokens at 1,790 B: 16 M fit, 34 M do not.
    plan = plan_segment(FULL, 4, 1, 127, 5000, options, MemoryBudget(kv_tokens=16 * LIMIT))
    assert plan.cache_bytes == 16 * LIMIT * 1790 + window_bytes(FULL)
    with pytest.raises(PlanRefused, match="R10"):
        plan_segment(FULL, 4, 1, 127, 5000, options, MemoryBudget(kv_tokens=34 * LIMIT))
    assert [p.layer for p in plan.index_paths] == [20, 24, 28, 32, 36]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_kernel_tiles_are_the_segment_plans(world):
    """Issue #13: the tiles the model options carry are the plan's (R4 head tile, §B.3a decode tile, §E BM)."""
    cfg = load_named("dsv41_flash")
    tiles = kernel_tiles(cfg, world)
    for rank in range(world):
        seg = plan_segment(cfg, world, rank, 2048, 0, PlanOptions())
        assert tiles.attention_head_tile == seg.head_tile
        assert tiles.decode_head_tile == plan_decode_window(cfg, world, rank, 4, 0).head_tile
    assert tiles.moe_block_m == MOE_TILE and tiles.index_budget == PlanOptions().index_budget
    assert tiles.decode_head_tile == min(DECODE_HEAD_TILE, cfg.num_attention_heads // world)
