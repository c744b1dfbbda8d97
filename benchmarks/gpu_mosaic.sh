#!/usr/bin/env bash
# One lent-H200 call (run from the repo root; $OUT set by the device tool): the Mosaic GPU score pass inside the
# indexer op (issue 15; opt-in, `pallas_kernels.indexer.kernel.SCORE_PASS`), before its default is flipped:
# - its tests compiled (the kernel bitwise against its reference; the op's picks equal the Triton pass's, incl. a
#   candidate-masked layer);
# - the op at 2,048 rows × 300 K keys with it (`bench_indexer.py --score-pass mosaic`);
# - the 2-layer prefill at 0 and 300,000 with it (issue 15's <= 1.6x).
# Each part has its own time limit (seconds, overridable by the variables named below); ~330 s in all.
set -u
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/gpu_mosaic}
mkdir -p "$OUT"
{
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; date -u
echo "== tests"
timeout ${TESTS_S:-120} python3 -m pytest -x -p no:cacheprovider -p no:randomly pallas_kernels/indexer/test_mosaic.py \
  > "$OUT/tests.txt" 2>&1
echo "tests exit status $? (log: tests.txt)"; date -u
echo "== bench_indexer, 2,048 rows at 300 K, mosaic score pass"
timeout ${INDEXER_S:-60} python3 benchmarks/bench_indexer.py --rows 2048 --positions 300000 --ratios 1,2 \
  --repeats 3 --score-pass mosaic 2>&1 | grep -E "^\| 2048"
date -u
echo "== profile 2 layers, pallas, mosaic score pass"
timeout ${PROFILE_S:-150} python3 -c "import sys; from pallas_kernels.indexer import kernel; kernel.SCORE_PASS = 'mosaic'
from dsv41_jax import profile; sys.exit(profile.main(sys.argv[1:]))" --config dsv41_flash --layers 2 --world 1 \
  --rows 2048 --position 0,300000 --impl pallas --repeats 7 --json-out "$OUT/profile.json" 2>&1 \
  | grep -E '^==|median|floor'
date -u
} 2>&1 | tee "$OUT/session.txt"
