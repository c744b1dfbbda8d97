"""CPU smoke run of benchmarks/bench_hc_product.py (the numbers mean something only on the GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_hc_product as bench

from dsv41_jax.model import norms


def test_quick_run_prints_both_ways_and_restores_the_threshold(capsys):
    before = norms.SPLIT_MIN_ROWS
    assert bench.main(["--quick"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(row[0], row[1]) for row in lines] == [("1", "f32"), ("1", "split"), ("16", "f32"), ("16", "split")]
    assert all(float(v) > 0 for row in lines for v in row[2:])
    assert norms.SPLIT_MIN_ROWS == before


def test_bad_rows_exit_2(capsys):
    assert bench.main(["--rows", "0"]) == 2
    assert "bench_hc_product:" in capsys.readouterr().err
