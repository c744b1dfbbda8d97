"""The server's scheduling flags and prefix caching, through a real server process (tests/test_serve.py's
`launch` / `stop`; the tiny random model, 32-row segments): the start-up line states the prefill segments, the
step's prefill budget and the prefix cache; a repeated long prompt is answered with the same tokens from its
cached prefix, and `/metrics` counts the lookup, the hit (vLLM's counters, in tokens) and the rows not computed
again; with ``--prefix-cache-gib 0`` nothing is cached. Bad values of the flags exit 2 with one line.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_serve import ROOT, _complete, _ids_prompt, _metric, _start, stop  # tests/ is on sys.path

httpx = pytest.importorskip("httpx")


def test_a_repeated_prompt_hits_its_cached_prefix():
    proc, url, lines = _start("--segment-rows", "32", "--max-prefill-tokens", "64")  # 16 rows: all row by row
    try:
        startup = "".join(lines)
        assert "prefill segments of 32 rows, at most 64 prefill rows a step" in startup
        assert "prefix cache: 1 GiB" in startup and "blocks of 32 tokens" in startup
        ids = _ids_prompt(80, 5)  # blocks 0-1 (64 tokens) usable: at least one row is left to prefill
        with httpx.Client(base_url=url, timeout=120) as http:
            cold = _complete(http, ids, 5)
            rows = _metric(url, "dsv41_prefill_rows_total")
            warm = _complete(http, ids, 5)
            assert warm == cold
            assert _metric(url, "vllm:prefix_cache_queries_total") == 2 * 80
            assert _metric(url, "vllm:prefix_cache_hits_total") == 64
            assert _metric(url, "dsv41_prefill_rows_total") - rows == 80 - 64
            assert _metric(url, "dsv41_prefix_cache_snapshots") == 2
    finally:
        stop(proc)


def test_bad_scheduling_flags_exit_2_with_one_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for flags in (["--max-prefill-tokens", "0"], ["--prefix-cache-gib", "-1"], ["--prefix-cache-gib", "nan"]):
        r = subprocess.run([sys.executable, "-m", "dsv41_jax.serve", *flags], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "error" in r.stderr, r.stderr
