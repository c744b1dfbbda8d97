#!/usr/bin/env bash
# The release as deployed, predicted on one H200: one rank of world 4 (40 layers, all 384 experts at its 576-column
# share, 16 heads, fp4 experts), dense weights as stored (fp8) and dequantised (bf16), greedy decode and prefill
# against their floors (issues 52 and 53), then the fp8 op's GPU tests. Run from the repository root on the GPU
# machine; tables and JSON go to $OUT (default /tmp/release_h200), traces under /tmp/release_h200_traces.
#   bash benchmarks/release_h200.sh decode    (~300 s) bench_decode, rank of 4, fp8 dense at batches 1/8/32 and
#                                              bf16 at batch 1, with the trace's kernels a step; the fp8 op's tests
#   bash benchmarks/release_h200.sh prefill   (~400 s) bench_prefill, rank of 4, 2,048 rows: at 0 with fp8 dense
#                                              (exact and fp8 GEMM inputs) and bf16 dense; at 300,000 (fp8, exact)
set -u
part=${1:-}
if [[ "$part" != decode && "$part" != prefill ]]; then
  echo "usage: bash benchmarks/release_h200.sh decode|prefill" >&2
  exit 2
fi
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/release_h200}
TRACES=/tmp/release_h200_traces
mkdir -p "$OUT" "$TRACES"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__)"
date -u
t0=$(date +%s)
rank4="--worlds none --rank-of 4 --layers 40 --formats fp4 --impl pallas"
if [ "$part" = decode ]; then
  for dense in fp8 bf16; do
    batches=1,8,32; [ "$dense" = bf16 ] && batches=1
    timeout "${LIMIT_S:-170}" python3 benchmarks/bench_decode.py $rank4 --dense-format $dense --batches $batches \
      --positions 0 --tokens 64 --steps 32 --trace "$TRACES/decode_$dense" --json-out "$OUT/decode_$dense.json" \
      2>&1 | grep -v "^WARNING" | tee "$OUT/decode_$dense.txt" | tail -14
    echo "decode $dense rc=${PIPESTATUS[0]} ($(( $(date +%s) - t0 )) s)"
  done
  timeout 120 python3 -m pytest -q -n 4 -p no:cacheprovider pallas_kernels/fp8_matmul tests/test_dense_fp8.py \
    2>&1 | tail -4
else
  for case in "fp8 exact 0" "fp8 fp8 0" "bf16 exact 0" "fp8 exact 300000"; do
    read -r dense inputs position <<< "$case"
    timeout "${LIMIT_S:-170}" python3 benchmarks/bench_prefill.py --worlds none --rank-of 4 --layers 40 --formats fp4 \
      --impl pallas --rows 2048 --position "$position" --dense-format "$dense" --gemm-inputs "$inputs" --no-trace \
      --json-out "$OUT/prefill_${dense}_${inputs}_$position.json" 2>&1 | grep -v "^WARNING" | tail -12
    echo "prefill dense $dense, inputs $inputs, at $position: rc=${PIPESTATUS[0]} ($(( $(date +%s) - t0 )) s)"
  done
fi
