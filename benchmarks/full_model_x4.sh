#!/usr/bin/env bash
# Issue #21 on 4 x H200: the whole released geometry (40 layers, fp4 routed experts as the release stores them,
# bf16 dense, random weights made on the devices) at world 4 — prefill of a 2,048-row segment and the decode step
# at the given positions, per-GPU memory against the planner. Run from the repo root; reports go to $OUT.
#   POSITIONS=0,100000 BATCHES="1" bash benchmarks/full_model_x4.sh
set -u
export PYTHONPATH=. XLA_PYTHON_CLIENT_MEM_FRACTION=.95 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/full_model_x4}
POSITIONS=${POSITIONS:-0,100000}
BATCHES=${BATCHES:-1}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for b in $BATCHES; do
  decode=--decode
  echo "== 40 layers, world 4, fp4 experts, batch $b, positions $POSITIONS =="
  python3 -m dsv41_jax.profile --config dsv41_flash --world 4 --rows 2048 --position "$POSITIONS" $decode \
    --batch "$b" --impl pallas --expert-format fp4 --repeats 3 --json-out "$OUT/full_w4_b$b.json" 2>&1 \
    | tee "$OUT/full_w4_b$b.log" | grep -v "^WARNING"
  echo "rc=${PIPESTATUS[0]}"
done
