"""``python -m dsv41_jax.profile`` on the tiny config (8 simulated CPU devices, conftest): the reported numbers are
present and sane, predicted bytes agree with XLA's, and the spec arithmetic and layer cut hold by hand."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv41_jax.profile as profile
from dsv41_jax.config import load_named
from dsv41_jax.formats import decode_fp4, decode_fp8
from dsv41_jax.model import ModelOptions
from dsv41_jax.param_specs import model_tensors
from dsv41_jax.planner import admit, engram_bytes_per_rank, param_bytes_per_rank, tensor_rank_shape
from dsv41_jax.profile import main
from dsv41_jax.profiling import build, trace
from dsv41_jax.profiling.cut import cut_layers, kept_layers, one_rank
from dsv41_jax.profiling.flops import step_flops
from dsv41_jax.profiling.trace import OpTime, by_component, by_layer, instruction_sources, part_of


def _run(capsys, *args) -> dict:
    # Four layers of tiny (window, ratio-2 full, ratio-1 full + candidate source, reindex): every code path
    # but reuse, at a third of the compile time of all ten.
    code = main(["--config", "tiny", "--layers", "4", "--json", "--repeats", "2", "--fast-compile", *args])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def _check_step(step: dict, world: int) -> None:
    assert step["error"] is None
    assert step["compile_s"] > 0
    flops = step["flops"]
    # XLA counts at least the spec's products; it counts more because the reference computes the window
    # attention densely over W + T keys, the indexer over the whole cache capacity, and XLA's CPU ragged dot
    # multiplies every routed row by every expert (E / k = 4 for tiny). 0.9 allows for ops the spec count
    # leaves out being fused away; 12 is that dense upper end with margin.
    assert flops["xla"] > 0 and 0.9 <= flops["xla_over_spec"] <= 12, flops
    mem = step["memory"]
    # Weights per device: the planner's count vs what the devices hold (padding included) — same tensors,
    # same shapes, so within 5 % (the bound; it is exact today).
    assert abs(mem["weights"]["diff_pct"]) <= 5, mem["weights"]
    # XLA's argument bytes = weights + cache + ids/lengths; the planner's cache differs from the model's
    # (2·W slot rings vs W-row rings, entries rounded down) by a few KiB, small next to the weights: 5 %.
    assert abs(mem["arguments"]["diff_pct"]) <= 5, mem["arguments"]
    # Cache: the planner's pool vs the model's cache arrays. Two known structural differences pull opposite
    # ways: the planner keeps 2·W-row slot rings a layer (the model W rows) and fp8 index keys (d_I + 4 B a
    # key; the model's are in the model dtype, bf16 here: 2·d_I B). Measured −0.8 % here; bound: a factor 4/3.
    cache = mem["cache"]
    assert 0.75 <= cache["predicted"] / cache["xla"] <= 4 / 3, cache
    # Temporaries: the planner's workspace is an upper bound on what a step may need, so it must never be
    # below XLA's temporaries. It is well above on tiny: the MoE z buffer is sized for a whole x3gm block of
    # routed pairs (PLANNER.md §B), not this segment's 64·k pairs (25 of the 29 MB predicted). Measured 5.3×
    # (decode) to 6.8× (prefill at world 1); bound 10×.
    temps = mem["temporaries"]
    assert temps["xla"] > 0 and temps["xla"] <= temps["predicted"] <= 10 * temps["xla"], temps
    assert step["median_s"] > 0 and step["tokens_per_s"] > 0
    assert len(step["times_s"]) == 2


@pytest.mark.devices(4)
def test_profile_tiny_world_1_and_4(capsys, tmp_path):
    one = _run(capsys, "--world", "1", "--rows", "64", "--position", "40", "--decode", "--trace", str(tmp_path))
    assert [s["kind"] for s in one["steps"]] == ["prefill", "decode"]
    # --trace: each step's trace split by part, and the optimised program beside it (the fusion behind an op name)
    for step in one["steps"]:
        assert "error" not in step["trace"] and step["trace"]["ops"]
        hlo = (tmp_path / f"{step['kind']}_p40" / "optimized_hlo.txt").read_text()
        assert all(f"{op['op']} = " in hlo for op in step["trace"]["ops"][:5])
    # the decode step donates its cache as the engine's does (a run does not copy the whole cache)
    assert [s["donated"] for s in one["steps"]] == [False, True]
    for step in one["steps"]:
        _check_step(step, 1)
    four = _run(capsys, "--world", "4", "--rows", "64", "--position", "40")
    _check_step(four["steps"][0], 4)
    # The planner's weight count, computed independently of the devices, and the split at world 4.
    cfg = cut_layers(load_named("tiny"), 4)
    assert one["weights_per_device"] == param_bytes_per_rank(cfg, 1, 0)
    assert four["weights_per_device"] < one["weights_per_device"] / 2
    # Same segment: the spec FLOPs per device shrink with the world (split parts), never below 1/4.
    spec1, spec4 = one["steps"][0]["flops"]["spec"], four["steps"][0]["flops"]["spec"]
    assert spec1 / 4 < spec4 < spec1


@pytest.mark.devices(2)
def test_profile_fp4_experts_as_released(capsys):
    """``--expert-format fp4``: experts drawn on the devices as packed codes + ue8m0 scales; the bytes each
    device holds are the planner's fp4 count exactly (world 2), the step runs, and decoded experts have the right
    spread."""


    report = _run(capsys, "--world", "2", "--rows", "16", "--position", "0", "--expert-format", "fp4")
    cfg = cut_layers(load_named("tiny"), 4)
    assert report["expert_format"] == "fp4" and report["steps"][0]["error"] is None
    assert report["weights_per_device"] == param_bytes_per_rank(cfg, 2, 0, experts="fp4")
    model, _ = build.build_model(cfg, 1, ModelOptions(dtype="float32", expert_format="fp4"))
    w1 = model.inner.layers[0].ffn.experts.w1
    values = np.asarray(decode_fp4(w1.codes[...], w1.scales[...], np.float32))
    fan_in = values.shape[-1]
    # Uniform random e2m1 codes have RMS ≈ 3.2 (values 0..6), the scale byte 2^round(log2(1/(2√fan_in))):
    # the decoded RMS is within a factor 2 of the dense init's 1/√fan_in.
    rms = float(np.sqrt(np.mean(values**2))) * np.sqrt(fan_in)
    assert 0.5 <= rms <= 2.5, rms
    assert len({int(b) for b in np.asarray(w1.codes[...]).ravel()[:4096]}) > 200  # codes cover the bytes


@pytest.mark.devices(2)
def test_profile_fp8_dense_weights_as_released(capsys):
    """``--dense-format fp8``: dense projections drawn on the devices as e4m3 codes + one ue8m0 byte a 32×32
    block; each device holds the planner's fp8 count exactly (world 2), the step runs, and decoded, their RMS is
    within the power-of-two rounding of the scale (a factor √2) of the dense init's 1/√fan_in."""
    report = _run(capsys, "--world", "2", "--rows", "16", "--position", "0", "--dense-format", "fp8")
    cfg = cut_layers(load_named("tiny"), 4)
    assert report["dense_format"] == "fp8" and report["steps"][0]["error"] is None
    assert report["weights_per_device"] == param_bytes_per_rank(cfg, 2, 0, dense="fp8")
    cfg = cut_layers(load_named("tiny"), 2)
    model, _ = build.build_model(cfg, 1, ModelOptions(dtype="float32", dense_format="fp8"))
    for proj in (model.inner.layers[0].attn.wq_a, model.inner.layers[0].ffn.shared_experts.w2):
        codes, scale = proj.weight[...], proj.scale[...]
        assert codes.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.uint8
        values = np.asarray(decode_fp8(codes, scale, jnp.float32))
        rms = float(np.sqrt(np.mean(values**2))) * np.sqrt(values.shape[-1])
        assert 0.65 <= rms <= 1.5, rms
        assert len(np.unique(np.asarray(codes.astype(jnp.float32)))) > 100  # codes spread over e4m3's values


def test_fewer_experts_cut_the_expert_weights(capsys):
    """``--experts``: the same layers with fewer routed experts (the 40-layer model on one H200): the planner's
    weights shrink by the dropped experts' bytes exactly."""
    cfg = cut_layers(load_named("tiny"), 4)
    fewer = _run(capsys, "--world", "1", "--rows", "16", "--position", "0", "--experts", "4", "--compile-only")
    assert fewer["weights_per_device"] == param_bytes_per_rank(cfg.replace(n_routed_experts=4), 1, 0)
    assert fewer["weights_per_device"] < param_bytes_per_rank(cfg, 1, 0)


@pytest.mark.parametrize("argv, message", [
    (["--world", "3"], "--world must be one of"),
    (["--rows", "0"], "--rows must be at least 1"),
    (["--position", "x"], "--position must be integers"),
    (["--layers", "0"], "--layers must be at least 1"),
    (["--config", "/nonexistent"], "no config file"),
    (["--position", "65500", "--rows", "64"], "passes the model's"),
    (["--engram"], "has no engram layers"),
    (["--config", "tiny_engram", "--engram-table-rows", "5000"], "goes with --engram"),
    (["--config", "tiny_engram", "--engram", "--engram-table-rows", "10"], "at least 1024"),
    (["--experts", "0"], "--experts must be at least 1"),
    (["--experts", "1"], "fewer than the 2 a token picks"),
    (["--rank-of", "3"], "--rank-of must be one of 1, 2, 4, 8"),
    (["--rank-of", "2", "--world", "2"], "drop --world 2"),
    (["--config", "tiny_engram", "--engram", "--rank-of", "2"], "drop --engram"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, message):
    assert main(["--config", "tiny", *argv] if "--config" not in argv else argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU's weights and caches are not in the host's memory")
def test_a_cpu_run_larger_than_the_host_s_memory_is_refused(capsys, monkeypatch):
    """On a CPU the simulated devices share the host's memory: a run whose planned weights + caches exceed what
    the host has available is one line and exit 2, not the OOM killer (as the full-width 2-layer cut was, ~54 GiB
    on a 24 GiB host). Here the host is said to have 1 MiB, against tiny's 11 MiB at world 2 (two devices' share)."""

    monkeypatch.setattr(profile, "available_host_bytes", lambda: 1 << 20)
    assert main(["--config", "tiny", "--world", "2", "--rows", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "0.01 GiB of host memory (2 simulated CPU devices), 0.00 GiB is available" in err
    assert len(err.splitlines()) == 1


def test_cut_layers_keeps_roles():
    """Full config: K = 2 keeps layer 2 (ratio-2 full) and layer 20 (ratio-1 full, candidate source), MODEL.md §A.2."""
    full = load_named("dsv41_flash")
    assert kept_layers(full, 2) == [2, 20]
    cut = cut_layers(full, 2)
    assert cut.compress_ratios == (2, 1) and cut.candidate_source_layer_id == 1
    assert [cut.role(i) for i in range(2)] == ["full", "full"]
    assert kept_layers(full, 4) == [0, 2, 20, 24]
    assert [cut_layers(full, 4).role(i) for i in range(4)] == ["window", "full", "full", "reindex"]
    assert cut_layers(full, 4).uses_candidates(3)  # layer 24 stays candidate-masked


@pytest.mark.parametrize("world", [2, 4, 8])
def test_one_rank_holds_a_rank_s_shards(world):
    """``one_rank`` (``--rank-of``): the one-device model of one rank of ``world`` has exactly the per-rank shapes
    the planner gives the widest rank's shards (``tensor_rank_shape``, MODEL.md §F.1: split heads, groups, expert
    width and vocabulary rows, at their padded widths) and every replicated tensor whole."""

    full = cut_layers(load_named("dsv41_flash"), 2)
    adm = admit(full, world)
    rank = model_tensors(one_rank(full, world), engram=False, dspark=False)
    whole = model_tensors(full, engram=False, dspark=False)
    assert rank.keys() == whole.keys()
    assert {n: rank[n] for n in rank} == {n: tensor_rank_shape(n, s, adm, adm.widest_rank) for n, s in whole.items()}
    assert sum(rank[n] != whole[n] for n in rank) >= 9  # embed, head, and 2 layers' heads, groups and experts


def test_cut_keeps_the_first_engram_layer_when_asked():
    """``engram=True``: the release's first engram layer (1, a window layer) comes first; its table keeps its rows
    or takes ``engram_table_rows``; without it engram is dropped as before."""
    full = load_named("dsv41_flash")
    assert kept_layers(full, 2, engram=True) == [1, 2]
    cut = cut_layers(full, 3, engram=True, engram_table_rows=1 << 20)
    assert kept_layers(full, 3, engram=True) == [1, 2, 20]
    assert cut.engram_layer_ids == (0,) and cut.engram_num_embeddings == (1 << 20,)
    assert cut_layers(full, 40, engram=True).engram_layer_ids == full.engram_layer_ids
    assert cut_layers(full, 3).engram_layer_ids == () and cut_layers(full, 40).engram_layer_ids == ()


@pytest.mark.devices(2)
def test_profile_keeps_engram_layers(capsys):
    """``--engram``: the engram layer runs in the profiled steps on the host's hashed rows, its table on the devices
    (split by hash column at world 2); the weights the devices hold, table included, are the planner's count."""

    argv = ["--config", "tiny_engram", "--layers", "3", "--world", "2", "--rows", "16", "--position", "0",
            "--json", "--repeats", "1", "--fast-compile", "--engram"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layers"] == [1, 2, 6] and report["engram"] == [{"layer": 1, "table_rows": 6126}]
    step = report["steps"][0]
    assert step["error"] is None and step["median_s"] > 0
    assert abs(step["memory"]["weights"]["diff_pct"]) <= 0.5, step["memory"]["weights"]
    cfg = cut_layers(load_named("tiny_engram"), 3, engram=True)
    engram = engram_bytes_per_rank(cfg, 2, tables="device")
    assert report["weights_per_device"] - param_bytes_per_rank(cfg, 2, 0) == engram["tables"] + engram["projection"]


def test_spec_flops_by_hand():
    """Decode at position 0 of a one-layer cut (layer 2 of tiny, ratio 2): terms written out from MODEL.md."""
    cfg = cut_layers(load_named("tiny"), 1)
    D, H, d, V = 64, 16, 64, 512
    parts = step_flops(cfg, rows=1, position=0, world=2)
    assert parts["head"] == 2 * D * V / 2
    # Router D·E + (k + shared)·3·D·F split over 2 ranks.
    assert parts["moe"] == 2 * (D * 8 + 3 * 3 * D * 256 / 2)
    # Position 0 sees one window row and no closed ratio-2 entry: QK + PV = 2·H·d MACs a key, heads split.
    assert parts["attn_core"] == 2 * 2 * H * d * 1 / 2
    # Ratio-2 compressor: wkv and wgate per row; no entry closes at position 0 (group 0 needs position 1).
    assert parts["compressor"] == 2 * 2 * D * d


def test_per_layer_view_from_the_model_scopes():
    """``Transformer`` names ``layer_N/attn`` and ``layer_N/moe``; the trace groups op times by them."""


    def f(x):
        with jax.named_scope("layer_3"):
            with jax.named_scope("moe"):
                x = jnp.sin(x) * 2
        return jnp.cos(x)

    sources = instruction_sources(jax.jit(f).lower(jnp.ones(4)).compile().as_text())
    assert any(label.startswith("L3/moe") for label in sources.values()), sources
    ops = [OpTime("a", "L3/moe moe.py:_routed", 2.0, 1), OpTime("b", "L10/attn attention.py:_attend", 1.0, 1),
           OpTime("c", "L3/moe hc.py:hc_mix", 1.0, 1), OpTime("d", "transformer.py:forward", 0.5, 1),
           OpTime("e", "L3 transformer.py:forward", 0.25, 1), OpTime("f", "L4-7/moe moe.py:_routed", 4.0, 1)]
    assert by_layer(ops) == [("L3", 0.25), ("L3/moe", 3.0), ("L4-7/moe", 4.0), ("L10/attn", 1.0), ("other", 0.5)]


def test_ops_xla_made_are_named_by_their_shape():
    """An instruction without a stack frame (XLA made it: the 40-layer batch-8 decode trace has ~32 µs a layer of
    such concatenations) is labelled by its result shape, counted under "xla" and in no model part."""

    text = """HloModule m
ENTRY %main (a: bf16[1280,5120], b: bf16[512,5120]) -> (bf16[1792,5120], f32[2]) {
  %input_concatenate_fusion.29 = bf16[1792,5120]{1,0} fusion(%a, %b), kind=kInput, calls=%fc
  ROOT %tuple.1 = (bf16[1792,5120]{1,0}, f32[2]{0}) tuple(%input_concatenate_fusion.29, %c)
}
"""
    sources = instruction_sources(text)
    label = sources["input_concatenate_fusion.29"]
    assert label == "xla→bf16[1792,5120]" and sources["tuple.1"] == "xla→tuple"
    assert part_of(label) == "other"
    ops = [OpTime("input_concatenate_fusion.29", label, 1.0, 1), OpTime("a", "L3/moe moe.py:_routed", 2.0, 1)]
    assert by_component(ops) == [("moe.py", 2.0), ("xla", 1.0)]
    assert by_layer(ops) == [("L3/moe", 2.0), ("other", 1.0)]


def test_scanned_run_scope():
    """A scanned run's ops sit under ``layers_A-B`` (`Transformer.forward`), inside the scan's body."""


    def f(x):
        with jax.named_scope("layers_4-7"):
            def body(c, w):
                with jax.named_scope("attn"):
                    return jnp.sin(c) * w, None
            return jax.lax.scan(body, x, jnp.arange(4.0))[0]

    sources = instruction_sources(jax.jit(f).lower(jnp.ones(4)).compile().as_text())
    assert any(label.startswith("L4-7/attn") for label in sources.values()), sources


def test_trace_names_device_work_outside_the_program_s_ops():
    """A GPU trace's kernels that name no instruction of the program (a command buffer's copy kernels, a memcpy)
    are summed by name per step; spans that are not device activity (a module's execution) and the program's
    own ops are not; a CPU trace (no device process) has none."""

    gpu = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
           {"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "/device:GPU:1"}}]
    kernel = lambda pid, name, dur, **args: {"ph": "X", "pid": pid, "tid": 1, "name": name, "dur": dur,
                                             "args": {"kernel_details": "grid:1,1,1", **args}}
    events = gpu + [
        kernel(7, "fusion_3", 10.0, hlo_op="fusion.3"), kernel(7, "fusion_3", 10.0, hlo_op="fusion.3"),
        kernel(7, "memcpy128", 48.0, hlo_op="command_buffer_1"),
        kernel(7, "memcpy128", 52.0, hlo_op="command_buffer_1"),
        {"ph": "X", "pid": 7, "tid": 2, "name": "MemcpyDtoD", "dur": 6.0, "args": {"memcpy_details": "size:8"}},
        {"ph": "X", "pid": 7, "tid": 3, "name": "jit_step", "dur": 900.0, "args": {}},   # the module's span
        kernel(9, "memcpy128", 99.0),                                                     # another device
    ]
    sources = {"fusion.3": "moe.py:10"}
    ops = trace.op_times(events, sources, steps=2)
    assert [(o.name, round(o.seconds * 1e6, 6), o.count) for o in ops] == [("fusion.3", 10.0, 1)]
    other = trace.unattributed_times(events, sources, steps=2)
    assert [(o.name, round(o.seconds * 1e6, 6), o.count) for o in other] == [("memcpy128", 50.0, 1),
                                                                             ("MemcpyDtoD", 3.0, 0)]
    cpu = [{"ph": "X", "pid": 1, "tid": 1, "name": "fusion.3", "dur": 5.0, "args": {}}]
    assert trace.unattributed_times(cpu, sources, steps=1) == []


def test_device_timeline_of_chained_calls():
    """Busy time counts overlapping activities once, gaps are what lies between them inside a call (those over 5
    µs apart) and, apart, between two calls; copies are memcpy kernels and memcpys; the warm-up call (the first,
    apart by a host wait) is dropped and the rest averaged per call; no device process (CPU) gives None."""

    meta = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}}]
    act = lambda ts, dur, name="k": {"ph": "X", "pid": 7, "tid": 1, "name": name, "ts": ts, "dur": dur,
                                      "args": {"kernel_details": "grid:1,1,1"}}
    call = lambda t0: [act(t0, 10.0), act(t0 + 5.0, 10.0), act(t0 + 16.0, 4.0, "memcpy128"), act(t0 + 30.0, 10.0)]
    span = {"ph": "X", "pid": 7, "tid": 2, "name": "jit_step", "ts": 0.0, "dur": 5000.0, "args": {}}
    events = meta + [span] + call(0.0) + call(1000.0) + call(1047.0)   # warm-up, a host wait, two chained calls
    tl = trace.device_timeline(events, calls=3)
    # a call: [0, 15] ∪ [16, 20] ∪ [30, 40] busy 29 µs, gaps 1 + 10 µs; then 7 µs to the next call
    assert tl.activities == 4
    assert round(tl.busy_s * 1e6, 6) == 29.0
    assert round(tl.gap_s * 1e6, 6) == 11.0 and round(tl.long_gap_s * 1e6, 6) == 10.0
    assert round(tl.between_s * 1e6, 6) == 7.0
    assert round(tl.copy_s * 1e6, 6) == 4.0
    assert trace.device_timeline([act(0.0, 1.0) | {"pid": 1}], calls=1) is None
    # a warm-up with its arguments' host-to-device copies (more extra activities than calls) is still cut at the
    # host's wait: the same per-call figures
    uploads = [act(-100.0 + 10 * i, 2.0, "MemcpyHtoD") for i in range(5)]
    events = meta + [span] + uploads + call(0.0) + call(1000.0) + call(1047.0) + call(1094.0)
    tl = trace.device_timeline(events, calls=4)
    assert tl.activities == 4
    assert round(tl.busy_s * 1e6, 6) == 29.0 and round(tl.gap_s * 1e6, 6) == 11.0
    assert round(tl.between_s * 1e6, 6) == 7.0
