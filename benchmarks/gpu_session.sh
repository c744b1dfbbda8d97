#!/usr/bin/env bash
# The checks owed after a session's CPU-only changes, one lent-H200 call per part (run from the repo root;
# $OUT set by the device tool; everything also lands in $OUT/session.txt):
#   bash benchmarks/gpu_session.sh kernels  (~460 s) the Mosaic GPU score pass inside the indexer op (issue 15;
#       kernel.SCORE_PASS, the default): its tests compiled (the kernel bitwise against its reference; the op's
#       picks equal the Triton pass's, incl. a candidate-masked layer), the op at 2,048 rows × 300 K with it;
#       `bench_moe --decode` (issue 14: the routed experts at 1 and 8 rows, bf16 and fp4, after their GPU
#       checks);
#       `bench_moe --prefill-sweep fp4` (the weights-first fp4 blocks checked against the f32 oracle
#       at 700 rows, F = 512 and 576 — down chunks 128 and 64 —, then fp4 at 2,048 rows, F = 1,152 / 576, swept);
#       the 2-layer prefill at 0 / 300,000 / ending at 1,048,576 (issues 15 and 22);
#   bash benchmarks/gpu_session.sh decode   (~600 s) the GPU tests of the engine's decode paths
#       (`tests/test_decode_step.py`, `tests/test_engine.py`, `tests/test_serve_slots.py`); `bench_decode`
#       (issue 14): batches 1/8/32 at 0 and 300 K; `bench_compile` of the 40-layer decode step (issue 14's
#       <= 15 s); the 2-layer prefill and decode at 0 and 300,000 with a trace (issues 15 and 22).
#   bash benchmarks/gpu_session.sh depth    (~500 s) the GPU tests of large expert stacks (`test_moe.py -k
#       on_the_gpu`); the whole 40-layer model's decode step (24 routed experts a
#       layer so bf16 fits one H200; its scanned units and loops as in the release): `bench_decode` at batches
#       1 and 8, positions 0 and 300,000 (issue 14: a 2-layer cut has no scanned unit), the same in fp4 at 0;
#       `bench_hc_product` (the HC product at few rows, both ways f32_matmul runs it: norms.SPLIT_MIN_ROWS).
#   bash benchmarks/gpu_session.sh worlds   (~560 s; on 2 or 4 GPUs) issues 14 and 22 across worlds: `bench_decode`
#       of the 2-layer cut at batches 1/8/32 and of the 40-layer model (24 experts) at batches 1/8, worlds 1, 2 (and
#       4 when four GPUs are there), with a trace (issue 14: world 2 and 4 faster than world 1); `bench_prefill` of
#       the 2-layer cut, 2,048 rows, worlds 1/2/4, row-parallel HC mixes off and on (issue 22's bounds).
#   bash benchmarks/gpu_session.sh collectives (~600 s; on 2 or 4 GPUs) tensor-parallel decode under the XLA
#       options for small all-reduces, one process each: the defaults (every all-reduce, ~2 a layer, ends one
#       command buffer and runs as an NCCL call), the all-reduces recorded into the command buffers
#       (`--xla_gpu_enable_command_buffer=+COLLECTIVES`), XLA's own one-shot all-reduce kernel instead of NCCL
#       (`--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true`), and both: the 2-layer cut at batches 1/8;
#       then 40 layers at batch 1 with the defaults and with both.
# Each step has its own time limit (seconds, overridable by the variables named below).
set -u
part=${1:-}
if [[ "$part" != kernels && "$part" != decode && "$part" != depth && "$part" != worlds && "$part" != collectives ]]; then
  echo "usage: bash benchmarks/gpu_session.sh kernels|decode|depth|worlds|collectives" >&2
  exit 2
fi
export PYTHONPATH=${PYTHONPATH:-.}:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"

kernels() {
  echo "== Mosaic GPU score pass: tests"
  timeout ${TESTS_S:-120} python3 -m pytest -x -p no:cacheprovider -p no:randomly \
    pallas_kernels/indexer/test_mosaic.py > "$OUT/mosaic_tests.txt" 2>&1
  echo "tests exit status $? (log: mosaic_tests.txt)"; date -u
  echo "== bench_indexer, 2,048 rows at 300 K, mosaic score pass"
  timeout ${INDEXER_S:-60} python3 benchmarks/bench_indexer.py --rows 2048 --positions 300000 --ratios 1,2 \
    --repeats 3 --score-pass mosaic 2>&1 | grep -E "^\| 2048"
  date -u
  echo "== bench_moe --decode"
  timeout ${MOE_S:-150} python3 benchmarks/bench_moe.py --decode 2>&1 | grep -E "^check|whole op"
  date -u
  echo "== bench_moe --prefill-sweep fp4 (the weights-first fp4 blocks: GPU check against the f32 oracle, sweep)"
  timeout ${MOE_FP4_S:-150} python3 benchmarks/bench_moe.py --prefill-sweep fp4 2>&1 \
    | grep -E "^check|gate_up|down|whole op"
  date -u
  echo "== profile 2 layers, pallas (Mosaic score pass)"
  timeout ${PROFILE_S:-200} python3 -m dsv41_jax.profile --config dsv41_flash --layers 2 --world 1 \
    --rows 2048 --position 0,300000,1046528 --impl pallas --repeats 7 --json-out "$OUT/profile_prefill.json" 2>&1 \
    | grep -E '^==|median|floor'
}

decode() {
  echo "== GPU tests"
  timeout ${TESTS_S:-200} python3 -m pytest -q -x -p no:cacheprovider tests/test_decode_step.py tests/test_engine.py \
    tests/test_serve_slots.py > "$OUT/tests.txt" 2>&1
  echo "tests exit status $? (log: tests.txt)"; date -u
  echo "== bench_decode, world 1, bf16"
  timeout ${DECODE_S:-150} python3 benchmarks/bench_decode.py --worlds 1 --batches 1,8,32 --positions 0,300000 \
    --formats bf16 --tokens 128 --steps 32 --json-out "$OUT/decode.json" 2>&1 | grep -v "^WARNING" | tail -8
  date -u
  echo "== bench_compile, 40-layer decode step"
  timeout ${COMPILE_S:-60} python3 benchmarks/bench_compile.py --modes scanned --steps decode \
    --json-out "$OUT/compile.json" 2>&1 | grep -E "^decode|^step|layers"
  date -u
  echo "== profile 2 layers, pallas"
  timeout ${PROFILE_S:-150} python3 -m dsv41_jax.profile --config dsv41_flash --layers 2 --world 1 --rows 2048 \
    --position 0,300000 --decode --impl pallas --repeats 7 --trace /tmp/gpu_session_trace \
    --json-out "$OUT/profile.json" > "$OUT/profile.txt" 2>&1
  grep -E '^==|median|floor|by part' "$OUT/profile.txt"
}

depth() {
  echo "== large expert stacks on the GPU (read in place; fp4 codes as 16-bit words, stacks of 2-4 GiB included)"
  timeout ${STACK_S:-150} python3 -m pytest -q -x -p no:cacheprovider pallas_kernels/moe/test_moe.py \
    -k on_the_gpu > "$OUT/stack_tests.txt" 2>&1
  echo "tests exit status $? (log: stack_tests.txt)"; date -u
  echo "== bench_decode, 40 layers, 24 routed experts a layer, bf16"
  timeout ${DEPTH_S:-240} python3 benchmarks/bench_decode.py --layers 40 --experts 24 --worlds 1 --batches 1,8 \
    --positions 0,300000 --formats bf16 --tokens 64 --steps 32 --json-out "$OUT/depth.json" 2>&1 \
    | grep -v "^WARNING" | tail -5
  date -u
  echo "== bench_decode, 40 layers, 24 fp4 routed experts a layer (units of 5 layers hold 2.1 GB of codes a matrix, read in place as words)"
  timeout ${DEPTH_FP4_S:-150} python3 benchmarks/bench_decode.py --layers 40 --experts 24 --worlds 1 --batches 1,8 \
    --positions 0 --formats fp4 --tokens 64 --steps 32 --json-out "$OUT/depth_fp4.json" 2>&1 \
    | grep -v "^WARNING" | tail -3
  date -u
  echo "== bench_hc_product"
  timeout ${HC_S:-90} python3 benchmarks/bench_hc_product.py 2>&1 | grep -v "^WARNING"
}

worlds() {
  export NCCL_NVLS_ENABLE=0
  local worlds
  worlds=$(python3 -c "import jax; n = len(jax.devices()); print(','.join(str(w) for w in (1, 2, 4) if w <= n))")
  echo "== bench_decode, 2-layer cut, worlds $worlds, bf16"
  timeout ${DECODE_S:-180} python3 benchmarks/bench_decode.py --worlds "$worlds" --batches 1,8,32 --positions 0 \
    --formats bf16 --tokens 64 --steps 32 --trace /tmp/gpu_session_worlds --json-out "$OUT/decode_worlds.json" 2>&1 \
    | grep -v "^WARNING" | tail -22
  date -u
  echo "== bench_decode, 40 layers (24 experts), worlds $worlds, bf16"
  timeout ${DEPTH_S:-200} python3 benchmarks/bench_decode.py --layers 40 --experts 24 --worlds "$worlds" \
    --batches 1,8 --positions 0 --formats bf16 --tokens 32 --steps 32 --json-out "$OUT/depth_worlds.json" 2>&1 \
    | grep -v "^WARNING" | tail -8
  date -u
  echo "== bench_prefill, 2-layer cut, 2,048 rows, worlds $worlds, row-parallel HC off / on"
  timeout ${PREFILL_S:-180} python3 benchmarks/bench_prefill.py --layers 2 --worlds "$worlds" --rows 2048 \
    --row-parallel-rows 0,1024 --json-out "$OUT/prefill_worlds.json" 2>&1 | grep -v "^WARNING" | tail -12
}

collectives() {
  export NCCL_NVLS_ENABLE=0
  local worlds in_graphs=--xla_gpu_enable_command_buffer=+COLLECTIVES
  local one_shot=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true
  worlds=$(python3 -c "import jax; n = len(jax.devices()); print(','.join(str(w) for w in (1, 2, 4) if w <= n))")
  local settings=("" "$in_graphs" "$one_shot" "$in_graphs $one_shot") taken=()
  for setting in "${settings[@]}"; do
    if ! XLA_FLAGS="$setting" python3 -c "import jax; jax.devices()" > /dev/null 2>&1; then
      echo "this XLA does not take '$setting': skipped"; continue
    fi
    taken+=("$setting")
    echo "== bench_decode, 2-layer cut, worlds $worlds, bf16, XLA_FLAGS='$setting'"
    XLA_FLAGS="$setting" timeout ${DECODE_S:-100} python3 benchmarks/bench_decode.py --worlds "$worlds" --batches 1,8 \
      --positions 0 --formats bf16 --tokens 64 --steps 32 --json-out "$OUT/collectives_2_${#taken[@]}.json" \
      2>&1 | grep -v "^WARNING" | tail -7
    date -u
  done
  (( ${#taken[@]} )) || return
  local ends=("${taken[0]}")  # the defaults and the most the XLA took (once, when it took no option)
  (( ${#taken[@]} > 1 )) && ends+=("${taken[-1]}")
  for setting in "${ends[@]}"; do
    echo "== bench_decode, 40 layers (24 experts), worlds $worlds, bf16, batch 1, XLA_FLAGS='$setting'"
    XLA_FLAGS="$setting" timeout ${DEPTH_S:-120} python3 benchmarks/bench_decode.py --layers 40 --experts 24 \
      --worlds "$worlds" --batches 1 --positions 0 --formats bf16 --tokens 32 --steps 32 \
      --json-out "$OUT/collectives_40${setting:+_flags}.json" 2>&1 | grep -v "^WARNING" | tail -4
    date -u
  done
}

{
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; date -u
"$part"
date -u
} 2>&1 | tee "$OUT/session.txt"
