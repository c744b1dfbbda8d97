"""benchmarks/bench_prefill.py (issue #22): a smoke run on the tiny config (the numbers are the H200's
business), the floors it reports against their definition, the trace's per-part split, and bad input."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41_jax.profiling import floors, trace

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_prefill.py"
_spec = importlib.util.spec_from_file_location("bench_prefill", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.slow  # a benchmark's run: a developer's tool, not a user's path (`make test-all`, the GPU suite)
def test_smoke_run_reports_floors_and_the_split(tmp_path):
    """Run as a user runs it, in a process of its own: on a GPU the trace's ops are named only with XLA's command
    buffers off, a flag the script sets before JAX starts (a test session's JAX has started long before)."""
    out = tmp_path / "prefill.json"
    # Two segment sizes; the second passes the tiny model's positions: reported as that case's error, the grid
    # goes on, exit code 1.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_PATH.parents[1]),
                                                                     os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(_PATH), "--config", "tiny", "--worlds", "1", "--layers", "2",
                           "--rows", "16,1000000", "--formats", "bf16", "--repeats", "1",
                           "--trace", str(tmp_path / "trace"), "--json-out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    ok, refused = json.loads(out.read_text())["rows"]
    assert (ok["world"], ok["layers"], ok["rows"], ok["experts"]) == (1, 2, 16, "bf16")
    assert ok["step_ms"] > 0 and ok["floor_ms"] == max(ok["read_ms"], ok["compute_ms"]) > 0
    assert math.isclose(ok["ratio"], ok["step_ms"] / ok["floor_ms"], rel_tol=1e-9)
    assert {"moe", "attention", "hc", "indexer", "head"} <= set(ok["parts_ms"])  # the trace's ops attributed
    assert "positions" in refused["error"] and "step_ms" not in refused
    assert "split (ms)" in done.stdout and "positions" in done.stdout


def test_step_floor_is_the_larger_bound():
    f = floors.step_floor(4.3e12, 6.68e14 * 2)
    assert (f["read_s"], f["compute_s"], f["floor_s"]) == pytest.approx((1.0, 2.0, 2.0))


@pytest.mark.parametrize("label,part", [
    ("L0/moe kernel.py:gate_up", "moe"), ("L1/moe grouping.py:_counted_tiles", "moe"),
    ("L0/attn compressor.py:Compressor.__call__", "compressor"),
    ("L1/attn attention.py:Attention._compress", "compressor"),
    ("L1/attn kernel.py:_maxima", "indexer"), ("L1/attn kernel.py:best_groups", "indexer"),
    ("L1/attn kernel.py:_rescore", "indexer"), ("L0/attn xla.py:select", "indexer"),
    ("L1/attn kernel.py:_row_maxima", "indexer"), ("L1/attn kernel.py:top_k_indices", "indexer"),
    ("L0/attn kernel.py:_score_operands", "indexer"), ("L0/attn kernel.py:index_topk_pallas", "indexer"),
    ("L0/attn kernel.py:sparse_attention_pallas", "attention"), ("L0/attn attention.py:Attention._output", "attention"),
    ("L1/moe hc.py:hc_mix", "hc"), ("L0/attn kernel.py:comb_pallas", "hc"), ("transformer.py:Head.__call__", "head"),
    ("", "other")])
def test_ops_are_attributed_to_their_part(label, part):
    """Labels as the H200 trace of the 2-layer cut names them (2026-12-01, the indexer's at 22:57 UTC; its decode
    rows' kernels on 2026-12-02, which "other" had taken: 0.14 ms of a step at 300 K)."""
    assert trace.part_of(label) == part


@pytest.mark.parametrize("argv", [["--formats", "fp8"], ["--rows", "0"], ["--worlds", "3"], ["--layers", "x"],
                                  ["--row-parallel-rows", "-1"], ["--rank-of", "6"]])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and "bench_prefill:" in capsys.readouterr().err
