#!/usr/bin/env bash
# One lent-H200 call of the checks owed from the last session (run from the repo root; $OUT set by the device
# tool): the indexer's group size (G = 4 / 8 / 16 keys a maximum: the rescore gathers K·G keys a row, ~0.5 ms a
# layer at G = 8, while the maxima and their selection grow as 1/G) at 300 K, then the 2-layer prefill at 0 and
# 300,000 (issue 15's ≤ 1.6× bound: 1.68× on 2026-12-02) and the chained decode steps (issue 14).
# Each part has its own time limit (seconds, overridable by the variables named below).
set -u
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
for g in 8 4 16; do
  echo "== bench_indexer, 2,048 rows at 300 K, group $g"
  timeout ${INDEXER_S:-90} python3 benchmarks/bench_indexer.py --rows 2048 --positions 300000 --ratios 1,2 \
    --group "$g" --repeats 5 2>&1 | grep "pallas bf16"
done
echo "== profile 2 layers, pallas"
timeout ${PROFILE_S:-170} python3 -m dsv41_jax.profile --config dsv41_flash --layers 2 --world 1 --rows 2048 \
  --position 0,300000 --decode --impl pallas --repeats 7 --json-out "$OUT/profile.json" 2>&1 \
  | grep -E '^==|median|floor'
echo "== bench_decode, world 1, bf16"
timeout ${DECODE_S:-200} python3 benchmarks/bench_decode.py --worlds 1 --batches 1,8,32 --positions 0,300000 \
  --formats bf16 --tokens 128 --steps 32 --json-out "$OUT/decode.json" 2>&1 | grep -v "^WARNING" | tail -8
