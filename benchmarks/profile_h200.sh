#!/usr/bin/env bash
# The H200 runs of docs/BENCHMARKS.md (issue #8): a 2-layer full-width model (layers 2 and 20 of
# dsv41_flash: ratio-2 full + ratio-1 full/candidate source) at world 1, prefill of 2,048 rows and decode, at
# positions 0 and 300,000, reference ops then Pallas ops. Run from the repo root; reports go to $OUT.
set -u
export PYTHONPATH=. XLA_PYTHON_CLIENT_MEM_FRACTION=.95 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/profile_h200}
BUDGET_S=${BUDGET_S:-270}  # both runs together end within this many seconds
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
end=$((SECONDS + BUDGET_S))
for impl in reference pallas; do
  left=$((end - SECONDS))
  [ "$impl" = reference ] && limit=$((left * 3 / 5)) || limit=$left
  echo "== impl $impl (limit ${limit} s) =="
  timeout "$limit" python3 -m dsv41_jax.profile --config dsv41_flash --layers 2 --world 1 --rows 2048 \
    --position 0,300000 --decode --impl "$impl" --repeats 5 --trace "/tmp/trace_$impl" \
    --json-out "$OUT/$impl.json" 2>&1 | tee "$OUT/$impl.log" | grep -v "^WARNING"
  echo "rc=${PIPESTATUS[0]}"
done
