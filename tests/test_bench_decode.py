"""benchmarks/bench_decode.py: a smoke run on the tiny config (the numbers are the H200's business), the floor
arithmetic it uses (`profiling/floors.py`) against hand counts, and bad flags refused with exit code 2."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import jax
import pytest

from dsv41_jax.config import load_named
from dsv41_jax.profiling import floors
from dsv41_jax.profiling.args import world_label

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_decode.py"
_spec = importlib.util.spec_from_file_location("bench_decode", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_distinct_experts_limits():
    """One token touches exactly k experts; many tokens approach all E; two tokens: 2k minus the expected
    overlap k·k/E."""
    assert floors.distinct_experts(384, 6, 1) == pytest.approx(6)
    assert floors.distinct_experts(384, 6, 10_000) == pytest.approx(384)
    assert floors.distinct_experts(384, 6, 2) == pytest.approx(12 - 36 / 384)


def test_cache_bytes_counts_windows_picks_and_index_keys():
    cfg = load_named("tiny")
    at0 = floors.cache_bytes(cfg, 1, 0)
    assert at0 == 2 * cfg.num_hidden_layers * cfg.sliding_window * cfg.head_dim
    # Position 4096: every layer with a ratio adds its top-k picks; every indexer all keys of its key source.
    want = at0
    for layer in range(cfg.num_hidden_layers):
        r = cfg.ratio(layer)
        if r > 0:
            want += 2 * min(cfg.index_topk, 4096 // r) * cfg.head_dim
            if layer in cfg.index_source_layer_ids:
                want += 2 * (4096 // cfg.ratio(cfg.index_key_source(layer))) * cfg.index_head_dim
    assert floors.cache_bytes(cfg, 3, 4096) == 3 * want


@pytest.mark.slow  # a benchmark's run: a developer's tool, not a user's path (`make test-all`, the GPU suite)
def test_quick_smoke_run(tmp_path, capsys):
    """On the CPU or a GPU (``make test-gpu``): the rows, the floors, the traced steps' kernel share, and the device
    timeline where there is a device (a CPU trace has no device process)."""

    out = tmp_path / "decode.json"
    assert bench.main(["--config", "tiny", "--quick", "--tokens", "6", "--steps", "3", "--decode-chunks", "1,3",
                       "--json-out", str(out),
                       "--trace", str(tmp_path / "trace")]) == 0
    report = json.loads(out.read_text())
    row, chunked = report["rows"]  # one row per decode chunk, the step-only figures shared
    assert (row["world"], row["experts"], row["batch"], row["position"], row["tokens"]) == (1, "bf16", 1, 0, 6)
    assert (row["chunk"], chunked["chunk"], chunked["tokens"], chunked["step_ms"]) == (1, 3, 6, row["step_ms"])
    assert row["step_ms"] > 0 and row["sampled_ms"] > 0 and row["floor_ms"] > 0 and row["gen_tok_s"] > 0
    assert math.isclose(row["ratio"], row["step_ms"] / row["floor_ms"], rel_tol=1e-9)
    assert row["kernel_share"] > 0  # the traced steps' XLA ops were found and attributed
    if jax.default_backend() == "cpu":
        assert row["timeline"] is None
    else:
        assert row["timeline"]["busy_s"] > 0 and row["timeline"]["activities"] > 0
    assert "step tok/s" in capsys.readouterr().out
    assert "xla_gpu_graph_enable_concurrent_region" in report["xla_flags"]  # the flags it ran with (A/B runs)


def test_timeline_table_row():
    """A traced device case's second-table row: a step's busy time, gaps inside it, those over 5 µs, the gap between
    steps and the copies, in ms, with the activity count (a JSON from before ``between_s`` reads 0 there)."""
    timeline = {"busy_s": 0.91e-3, "gap_s": 0.05e-3, "long_gap_s": 0.03e-3, "copy_s": 3e-6, "activities": 145,
                "between_s": 0.6e-3}
    row = {"world": 2, "experts": "bf16", "batch": 1, "position": 0, "step_ms": 1.002, "timeline": timeline}
    assert bench.fmt_timeline(row).split() == ["2", "bf16", "1", "0", "1.002", "0.910", "0.050", "0.030", "0.600",
                                               "0.003", "145"]
    older = {**row, "timeline": {k: v for k, v in timeline.items() if k != "between_s"}}
    assert bench.fmt_timeline(older).split()[8] == "0.000"


@pytest.mark.slow  # a benchmark's run: a developer's tool, not a user's path (`make test-all`, the GPU suite)
def test_whole_depth_with_fewer_experts(tmp_path):
    """``--experts``: the layers as configured (scanned units included) with fewer routed experts a layer (the
    40-layer model on one H200); fewer than a token picks is refused."""
    out = tmp_path / "decode.json"
    assert bench.main(["--config", "tiny", "--layers", "99", "--experts", "4", "--quick", "--tokens", "2",
                       "--steps", "1", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["routed_experts"] == 4 and report["rows"][0]["step_ms"] > 0
    assert bench.main(["--config", "tiny", "--experts", "1", "--quick"]) == 2


@pytest.mark.slow  # a benchmark's run: a developer's tool, not a user's path (`make test-all`, the GPU suite)
def test_rank_of_runs_one_rank_s_model_on_one_device(tmp_path, monkeypatch, capsys):
    """``--rank-of 2``: after world 1, the model of one rank of world 2 (``one_rank``: half the heads, groups,
    expert columns and vocabulary rows) built for one device and timed, labelled 1/2. The timing itself is
    ``run_case``'s (the smoke run above); here it reports what it was given."""
    built = []

    def fake_case(model, mesh, cfg, **kwargs):
        built.append((mesh.size, cfg.num_attention_heads, cfg.moe_intermediate_size, cfg.vocab_size))
        row = dict.fromkeys(("step_ms", "sampled_ms", "floor_ms", "ratio", "experts_per_layer", "step_tok_s",
                             "gen_tok_s", "gen_over_step"), 1.0)
        return [{**row, "batch": 1, "position": 0, "chunk": 1, "kernel_share": None, "timeline": None,
                 "case_s": 0.0}]

    monkeypatch.setattr(bench, "run_case", fake_case)
    out = tmp_path / "decode.json"
    assert bench.main(["--config", "tiny", "--quick", "--rank-of", "2", "--json-out", str(out)]) == 0
    cfg = load_named("tiny")
    assert built == [(1, cfg.num_attention_heads, cfg.moe_intermediate_size, cfg.vocab_size),
                     (1, cfg.num_attention_heads // 2, cfg.moe_intermediate_size // 2, cfg.vocab_size // 2)]
    whole, rank = json.loads(out.read_text())["rows"]
    assert (whole["rank_of"], rank["rank_of"], rank["world"]) == (0, 2, 1)
    assert world_label(rank) == "1/2" and "  1/2 " in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--formats", "fp8"], ["--batches", "0"], ["--worlds", "64"],
                                  ["--positions", "x"], ["--decode-chunks", "0"], ["--experts", "0"],
                                  ["--rank-of", "3"]])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and "bench_decode:" in capsys.readouterr().err
