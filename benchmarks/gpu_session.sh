#!/usr/bin/env bash
# One lent-H200 call of this session's checks (run from the repo root, $OUT set by the device tool):
# GPU tests of the kernels and of the previously failing GPU cases, the indexer and vision benchmarks, and the
# 2-layer profile at positions 0 and 300,000 with every Pallas kernel. Each part has its own time limit.
set -u
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
[ -f diag_moe.py ] && timeout 60 python3 diag_moe.py 2>&1 | grep diag
echo "== GPU tests"
JAX_PLATFORMS=cuda timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -x ${TESTS:-pallas_kernels} \
  2>&1 | grep -v "^WARNING\|Deprecat\|return rule" | tail -25
echo "== bench_indexer"
timeout ${INDEXER_S:-150} python3 benchmarks/bench_indexer.py --quick --json "$OUT/indexer.json" 2>&1 | grep -v "^WARNING"
echo "== bench_vision"
timeout ${VISION_S:-60} python3 benchmarks/bench_vision.py --json "$OUT/vision.json" 2>&1 | grep -v "^WARNING"
echo "== profile 2 layers, pallas"
timeout ${PROFILE_S:-170} python3 -m dsv41_jax.profile --config dsv41_flash --layers 2 --world 1 --rows 2048 \
  --position 0,300000 --decode --impl pallas --repeats 5 --compile-cache off --json-out "$OUT/profile.json" 2>&1 \
  | grep -v "^WARNING"
