#!/usr/bin/env bash
# Issue #21: generate end to end on the GPUs at world 1 and world N (embedded tiny model, float32, a prompt of
# 3,000 random ids, 256 new greedy tokens) and whether the tokens agree. ROUNDING=--no-quant-rounding compares
# without the §C.2 rounding points (whose fp4 boundary flips make long greedy runs diverge on random weights).
# Run from the repo root.
#   WORLD=4 IMPL=reference bash benchmarks/generate_worlds.sh
set -u
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/generate_worlds}
WORLD=${WORLD:-4}
IMPL=${IMPL:-reference}
ROUNDING=${ROUNDING:---quant-rounding}
mkdir -p "$OUT"
python3 -c "import json, numpy as np; ids = np.random.default_rng(7).integers(3, 500, 3000).tolist(); \
print(json.dumps({'prompt_ids': ids, 'max_new_tokens': 256}))" > "$OUT/prompt.jsonl"
for w in 1 "$WORLD"; do
  python3 -m dsv41_jax.generate --prompts-file "$OUT/prompt.jsonl" --greedy --dtype float32 --impl "$IMPL" $ROUNDING \
    --world "$w" --json > "$OUT/w$w.json" 2> "$OUT/w$w.err"; echo "world $w rc=$?"; tail -2 "$OUT/w$w.err"
done
python3 - "$OUT/w1.json" "$OUT/w$WORLD.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
ta, tb = a["results"][0]["generated_ids"], b["results"][0]["generated_ids"]
same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
print(f"tokens {len(ta)} vs {len(tb)}; first difference at {same}" if same is not None else
      f"tokens {len(ta)} vs {len(tb)}: identical")
for name, r in (("w1", a), ("wN", b)):
    print(name, {k: r["timings"][k] for k in ("prefill_tok_s", "decode_tok_s", "compile_s") if k in r["timings"]})
PY
