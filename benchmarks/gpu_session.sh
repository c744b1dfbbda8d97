#!/usr/bin/env bash
# One lent-H200 call of the checks owed from the last session (run from the repo root; $OUT set by the device
# tool; everything also lands in $OUT/session.txt):
# - the GPU tests of what changed without a device run: the profile steps taking a FlatState, the greedy
#   (argmax-only) step program, the indexer's G = 1 launches (`pallas_kernels/indexer`, `tests/test_decode_step.py`,
#   `tests/test_engine.py`, `tests/model/test_indexer_switch.py`);
# - `bench_decode` on the greedy step program and, beside it, the sampled one (issue 14: batch 1 read 1.50-1.51x
#   its floor in a `_gpu` loop on 2026-12-02, not yet in `bench_decode`'s table), batches 1/8/32 at 0 and 300 K;
# - the 2-layer prefill at 0 and 300,000 (issue 15's <= 1.6x bound: 1.685x on 2026-12-02; issue 22's world-1
#   <= 20 ms: 21.60 ms).
# Each part has its own time limit (seconds, overridable by the variables named below).
set -u
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
{
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "== GPU tests"
timeout ${TESTS_S:-200} python3 -m pytest -q -x -p no:cacheprovider pallas_kernels/indexer tests/test_decode_step.py \
  tests/test_engine.py tests/model/test_indexer_switch.py > "$OUT/tests.txt" 2>&1
echo "tests exit status $? (log: tests.txt)"
echo "== bench_decode, world 1, bf16, greedy"
timeout ${DECODE_S:-200} python3 benchmarks/bench_decode.py --worlds 1 --batches 1,8,32 --positions 0,300000 \
  --formats bf16 --tokens 128 --steps 32 --json-out "$OUT/decode.json" 2>&1 | grep -v "^WARNING" | tail -8
echo "== profile 2 layers, pallas"
timeout ${PROFILE_S:-170} python3 -m dsv41_jax.profile --config dsv41_flash --layers 2 --world 1 --rows 2048 \
  --position 0,300000 --decode --impl pallas --repeats 7 --json-out "$OUT/profile.json" 2>&1 \
  | grep -E '^==|median|floor'
} 2>&1 | tee "$OUT/session.txt"
