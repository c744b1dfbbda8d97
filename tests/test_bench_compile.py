"""benchmarks/bench_compile.py: a CPU smoke run on the tiny config (cold compile, then the second run loading
the executable from the store), an extra XLA option passed through, and a malformed option refused."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_compile.py"
_spec = importlib.util.spec_from_file_location("bench_compile", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.slow  # a benchmark's run: a developer's tool, not a user's path (`make test-all`, the GPU suite)
def test_smoke_run_with_an_extra_option(tmp_path, capsys):
    out = tmp_path / "compile.json"
    assert bench.main(["--config", "tiny", "--layers", "2", "--impl", "xla", "--rows", "8", "--modes", "scanned",
                       "--xla-option", "xla_backend_optimization_level=0", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["xla_options"] == {"xla_backend_optimization_level": 0}
    assert [s["step"] for s in report["steps"]] == ["decode", "prefill"]
    assert all(s["compile_s"] > 0 and s["load_s"] is not None for s in report["steps"])  # the second run loads
    assert "extra XLA options" in capsys.readouterr().out


def test_malformed_option_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse(["--xla-option", "no_value"])
    assert e.value.code == 2 and "KEY=VALUE" in capsys.readouterr().err
