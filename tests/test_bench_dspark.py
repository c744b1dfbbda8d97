"""benchmarks/bench_dspark.py: a CPU smoke run on the tiny config (the numbers are the H200's business) with its
JSON rows, the extrapolation arithmetic, and bad flags refused."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dsv41_jax.config import load_named

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_dspark.py"
_spec = importlib.util.spec_from_file_location("bench_dspark", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_cut_keeps_the_stages():
    cfg = bench.with_stages(load_named("dsv41_flash"), 2)
    assert cfg.num_hidden_layers == 2 and cfg.num_nextn_predict_layers == 3
    assert cfg.dspark_target_layer_ids == (0, 0, 1) and cfg.compress_ratios[2:] == (0, 0, 0)


@pytest.mark.slow  # a benchmark's run: a developer's tool, not a user's path (`make test-all`, the GPU suite)
def test_tiny_run_prints_and_writes_rows(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench.main(["--config", "tiny", "--worlds", "1", "--steps", "1", "--position", "8",
                       "--json-out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "step6 ms" in text and "draft %" in text
    row = json.loads(out.read_text())["rows"][0]
    for key in ("step1_ms", "step6_ms", "ratio", "round_ms", "draft_ms", "stage_ms", "draft_pct_of_full_step"):
        assert row[key] > 0
    assert row["ratio"] == pytest.approx(row["step6_ms"] / row["step1_ms"])
    full1 = row["head1_ms"] + 10 * (row["step1_ms"] - row["head1_ms"]) / 2
    assert row["full1_ms"] == pytest.approx(full1)
    assert set(row["speedup_full"]) == {"1.5", "2.5", "3.5"}


@pytest.mark.parametrize("argv", [["--worlds", "x"], ["--draft-tokens", "6"], ["--steps", "0"]])
def test_bad_flags_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
