#!/usr/bin/env bash
# One H200 call for engram (issue 16), from the repo root, ≤ 6 min: the engram tests on the GPU (the world-2/4/8
# cases skip on one GPU; mlx-based ones skip without mlx), then benchmarks/bench_engram.py (device tables at the
# release size, host hash with/without the prefetch, host tables' gather rate, serial vs overlapped prefill).
set -u
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "== engram tests"
JAX_PLATFORMS=cuda timeout ${TESTS_S:-170} python3 -m pytest -q -rs -p no:cacheprovider --durations=8 \
  tests/test_engram_module.py tests/test_engram_hash.py tests/test_engram_planner.py tests/test_engram_sharding.py \
  2>&1 | grep -v "^WARNING\|Deprecat" | tail -30
echo "== bench_engram"
timeout ${BENCH_S:-170} python3 benchmarks/bench_engram.py 2>&1 | grep -v "^WARNING"
