#!/usr/bin/env bash
# Issue 18's GPU checks in one H200 call (≤ 10 min; run from the repo root): the vision tests on the GPU (the bf16
# tower through cuDNN's fused attention against the f32 tower, the planner's workspace against XLA's GPU
# temporaries, the mlx-vlm parity where mlx is installed), the tower benchmark with cuDNN attention (one image
# and a batch of 4: measured / floor / ratio) and with XLA attention for comparison, and generate --image.
# Results as JSON under $OUT. Each part has its own time limit.
set -u
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/vision_gpu}
mkdir -p "$OUT"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "== vision tests (GPU)"
JAX_PLATFORMS=cuda timeout ${TESTS_S:-200} python3 -m pytest -q -rs -p no:cacheprovider tests/test_vision_tower.py \
  tests/test_vision_planner.py tests/test_vision_model.py 2>&1 | grep -v "^WARNING\|Deprecat" | tail -15
echo "== bench_vision, auto attention (cuDNN in bf16)"
timeout ${BENCH_S:-150} python3 benchmarks/bench_vision.py --batch 4 --json "$OUT/vision.json" 2>&1 | grep -v "^WARNING"
echo "== bench_vision, XLA attention"
timeout ${XLA_S:-120} python3 benchmarks/bench_vision.py --attention xla --batch 2 --reps 5 \
  --json "$OUT/vision_xla.json" 2>&1 | grep -v "^WARNING"
echo "== generate --image (embedded tiny_vision)"
timeout ${GENERATE_S:-60} python3 -m dsv41_jax.generate --chat --image tests/fixtures/test_image.png \
  --prompt "What is this?" --max-new-tokens 8 --greedy --compile-cache off 2>&1 | tail -3
