#!/usr/bin/env bash
# One lent-H200 call of the checks owed from the last session (run from the repo root; $OUT set by the device
# tool): GPU tests of what changed (the f32 product split, group scans), the 40-layer compile with group scans
# and with XLA's parallel LLVM compilation A/B, and the 2-layer prefill/decode profile and prefill benchmark.
# Each part has its own time limit (seconds, overridable by the variables named below).
set -u
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "== GPU tests"
JAX_PLATFORMS=cuda timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -x \
  ${TESTS:-tests/model/test_numerics.py tests/model/test_scan_layers.py} 2>&1 | grep -v "^WARNING" | tail -15
echo "== bench_compile 40 layers: group scans, then + parallel LLVM compilation"
timeout ${COMPILE_S:-200} python3 benchmarks/bench_compile.py --modes scanned --json-out "$OUT/compile.json" 2>&1 \
  | grep -v "^WARNING"
timeout ${COMPILE_S:-200} python3 benchmarks/bench_compile.py --modes scanned --json-out "$OUT/compile_par.json" \
  --xla-option xla_gpu_enable_llvm_module_compilation_parallelism=true 2>&1 | grep -v "^WARNING"
echo "== profile 2 layers, pallas"
timeout ${PROFILE_S:-120} python3 -m dsv41_jax.profile --config dsv41_flash --layers 2 --world 1 --rows 2048 \
  --position 0 --decode --impl pallas --repeats 7 --trace /tmp/gpu_session_trace --json-out "$OUT/profile.json" \
  2>&1 | grep -v "^WARNING"
echo "== bench_prefill (worlds as the machine has)"
timeout ${PREFILL_S:-240} python3 benchmarks/bench_prefill.py --layers 2 --rows 2048 --formats bf16 \
  --json-out "$OUT/prefill.json" 2>&1 | grep -v "^WARNING"
