#!/usr/bin/env bash
# One lent-H200 call of the checks owed from the last session (run from the repo root; $OUT set by the device
# tool): GPU tests of the indexer (piece-by-piece selection of long rows, the rescore reading the key cache
# unpadded: both CPU-checked only), the indexer benchmark at 300 K and 1M keys, the 2-layer profile at 0,
# 300,000 and the maximum context, the 40-layer compile, and the prefill benchmark.
# Each part has its own time limit (seconds, overridable by the variables named below).
set -u
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "== GPU tests"
JAX_PLATFORMS=cuda timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider \
  ${TESTS:-pallas_kernels/indexer tests/model/test_indexer_switch.py tests/test_planner_indexer.py} 2>&1 \
  | grep -E '\[ *[0-9]+%\]|passed|failed|FAIL|Error' | tail -15
echo "== bench_indexer, 2,048 rows at 300 K and 1M"
timeout ${INDEXER_S:-150} python3 benchmarks/bench_indexer.py --rows 2048 --positions 300000,1048576 --ratios 1,2 \
  --json "$OUT/indexer.json" 2>&1 | grep -v "^WARNING" | sed -n '/^useful/,$p'
echo "== profile 2 layers, pallas"
timeout ${PROFILE_S:-170} python3 -m dsv41_jax.profile --config dsv41_flash --layers 2 --world 1 --rows 2048 \
  --position 0,300000,1046528 --decode --impl pallas --repeats 7 --json-out "$OUT/profile.json" 2>&1 \
  | grep -E '^==|median|floor'
echo "== bench_compile 40 layers (group scans)"
timeout ${COMPILE_S:-200} python3 benchmarks/bench_compile.py --modes scanned --json-out "$OUT/compile.json" 2>&1 \
  | grep -v "^WARNING\|^E1\|^W1"
echo "== bench_prefill (worlds as the machine has)"
timeout ${PREFILL_S:-240} python3 benchmarks/bench_prefill.py --layers 2 --rows 2048 --formats bf16 \
  --json-out "$OUT/prefill.json" 2>&1 | grep -v "^WARNING"
