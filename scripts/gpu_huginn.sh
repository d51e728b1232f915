#!/usr/bin/env bash
# Huginn-0125 on one GPU, in one call: its GPU tests (fp32 engine == serial reference, bf16 graphs
# == eager, alone == in a batch), then Huginn-0125 at full size (its published config.json
# verbatim, random bf16 weights, `python -m tests.published_configs huginn DIR`) through
# `loopserve generate` and `loopserve serve` with no sizing flags, and `loopserve bench offline`
# 512/128 at C = 1, 32, 128, fixed depth (32 loops) and its default trace (d12, mean 12), in the
# `shared` layout (32 `full` planes of 8 layers do not fit 128 requests).
# Device: carry `.carry/serve` (the server's cp312 wheels; scripts/gpu_serve_rates.sh says how to
#         build them) and run `OUT=$OUT bash scripts/gpu_huginn.sh`.
# Budget: about 9 minutes (tests ~2, checkpoint ~1, generate and serve ~1, bench ~5).
# Writes: $OUT/tests.log, $OUT/generate.{json,log}, $OUT/serve.log, $OUT/huginn.{jsonl,md},
#         $OUT/bench.log, $OUT/huginn.log (the step times).
set -uo pipefail

OUT="${OUT:-$PWD/huginn-out}"
PYTHON="${PYTHON:-python3}"
MODEL_DIR="${MODEL_DIR:-/tmp/huginn-0125-random}"
PORT="${PORT:-8768}"
BENCH_ARGS="${BENCH_ARGS:---workload 512/128 --concurrency 1,32,128 --exits fixed,trace \
--kv-layout shared --scheduling refill --graphs on --trials 1}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
LOG="$OUT/huginn.log"
started=$(date +%s)
say() { echo "== [$(($(date +%s) - started)) s] $*" | tee -a "$LOG"; }
# shellcheck source=scripts/lib/server.sh
source scripts/lib/server.sh

if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 300 "$PYTHON" -m pytest -q -m gpu tests/gpu/test_engine_huginn_gpu.py \
    >"$OUT/tests.log" 2>&1
  say "gpu tests rc=$? ($(tail -1 "$OUT/tests.log"))"
fi

if [ ! -f "$MODEL_DIR/config.json" ]; then
  "$PYTHON" -m tests.published_configs huginn "$MODEL_DIR" >>"$LOG" 2>&1
  say "checkpoint written: $(du -sh "$MODEL_DIR" | cut -f1)"
fi

timeout 180 "$PYTHON" -m loopserve.entrypoints.cli generate --model "$MODEL_DIR" --prompt Hi \
  --max-tokens 8 --json >"$OUT/generate.json" 2>"$OUT/generate.log"
say "generate rc=$? $(cat "$OUT/generate.json")"

timeout 420 "$PYTHON" -m loopserve.entrypoints.cli bench offline --model "$MODEL_DIR" \
  $BENCH_ARGS --device cuda --output "$OUT/huginn.jsonl" --summary "$OUT/huginn.md" \
  >"$OUT/bench.log" 2>&1
say "bench rc=$?"

say "$(serve_and_chat "$MODEL_DIR" "$PORT" "$OUT/serve.log")"
say "done"
