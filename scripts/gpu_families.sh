#!/usr/bin/env bash
# Issue 27 on one GPU, in one call: the looped families' GPU tests (Nanbeige's engine, kernels
# and fused ops), then Nanbeige4.2-3B at full size (its published config.json verbatim, random
# bf16 weights, `python -m tests.published_configs nanbeige DIR`) through `loopserve generate` and
# `loopserve serve` with no sizing flags, and `loopserve bench offline` 512/128 at C = 1, 32, 128,
# fixed depth and its default trace (d1.6).
# Device: carry `.carry/serve` (the server's cp312 wheels; scripts/gpu_serve_rates.sh says how to
#         build them) and run `OUT=$OUT bash scripts/gpu_families.sh`.
# Budget: about 9 minutes (tests ~3, checkpoint ~1, generate and serve ~1, bench ~4).
# Writes: $OUT/tests.log, $OUT/generate.{json,log}, $OUT/serve.log, $OUT/nanbeige.{jsonl,md},
#         $OUT/bench.log, $OUT/families.log (the step times).
set -uo pipefail

OUT="${OUT:-$PWD/families-out}"
PYTHON="${PYTHON:-python3}"
MODEL_DIR="${MODEL_DIR:-/tmp/nanbeige-4.2-3b-random}"
PORT="${PORT:-8767}"
BENCH_ARGS="${BENCH_ARGS:---workload 512/128 --concurrency 1,32,128 --exits fixed,trace \
--scheduling refill --graphs on --trials 2}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
LOG="$OUT/families.log"
started=$(date +%s)
say() { echo "== [$(($(date +%s) - started)) s] $*" | tee -a "$LOG"; }
# shellcheck source=scripts/lib/server.sh
source scripts/lib/server.sh

say "tests"
timeout 300 "$PYTHON" -m pytest -q -m gpu tests/gpu/test_engine_nanbeige_gpu.py \
  tests/kernels/test_kernels_gpu.py -k "nanbeige or test_engine_nanbeige" >"$OUT/tests.log" 2>&1
say "gpu tests rc=$? ($(tail -1 "$OUT/tests.log"))"
# The fused ops' tests carry no gpu mark: on a GPU machine they run compiled, on CUDA tensors.
timeout 60 "$PYTHON" -m pytest -q tests/kernels/test_fused_ops.py >>"$OUT/tests.log" 2>&1
say "fused-op tests rc=$? ($(tail -1 "$OUT/tests.log"))"

if [ ! -f "$MODEL_DIR/config.json" ]; then
  "$PYTHON" -m tests.published_configs nanbeige "$MODEL_DIR" >>"$LOG" 2>&1
  say "checkpoint written: $(du -sh "$MODEL_DIR" | cut -f1)"
fi

timeout 180 "$PYTHON" -m loopserve.entrypoints.cli generate --model "$MODEL_DIR" --prompt Hi \
  --json >"$OUT/generate.json" 2>"$OUT/generate.log"
say "generate rc=$? $(cat "$OUT/generate.json")"

timeout 300 "$PYTHON" -m loopserve.entrypoints.cli bench offline --model "$MODEL_DIR" \
  $BENCH_ARGS --device cuda --output "$OUT/nanbeige.jsonl" --summary "$OUT/nanbeige.md" \
  >"$OUT/bench.log" 2>&1
say "bench rc=$?"

say "$(serve_and_chat "$MODEL_DIR" "$PORT" "$OUT/serve.log")"
say "done"
