#!/usr/bin/env bash
# Structured outputs on one GPU, in one call: what a JSON schema on every request costs end to end
# (`python -m benchmarks.structured_cost`: the bench's random Ouro-1.4B checkpoint, bf16, 512/128,
# C = 1 and 32, fixed depth and the d2.6 trace, unconstrained and constrained alternated A B B A on
# one engine), then the GPU tests of constrained decoding (fused step with CUDA graphs == serial
# reference with grammars, no host synchronisation in constrained steady-state steps, fused ==
# torch bitwise with bitmasks).
# Device: carry `.carry/tokenizer` holding a 49,152-token tokenizer.json, made here with
#         `python -m benchmarks.structured_cost --build-tokenizer .carry/tokenizer/tokenizer.json`,
#         and run `OUT=$OUT bash scripts/gpu_structured.sh`.
# Budget: about 5 minutes (checkpoint ~1 the first time on a machine, bench ~2, tests ~2).
# Writes: $OUT/structured_cost.{jsonl,log}, $OUT/tests.log, $OUT/structured.log.
set -uo pipefail

OUT="${OUT:-$PWD/structured-out}"
PYTHON="${PYTHON:-python3}"
TOKENIZER="${TOKENIZER:-.carry/tokenizer/tokenizer.json}"
BENCH_ARGS="${BENCH_ARGS:---concurrency 1,32 --exits fixed,trace --workload 512/128}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
LOG="$OUT/structured.log"
started=$(date +%s)
say() { echo "== [$(($(date +%s) - started)) s] $*" | tee -a "$LOG"; }

say "git ${LOOPSERVE_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout 360 "$PYTHON" -m benchmarks.structured_cost --tokenizer "$TOKENIZER" $BENCH_ARGS \
    --out "$OUT/structured_cost.jsonl" >"$OUT/structured_cost.log" 2>&1
  say "bench rc=$?"
  tail -8 "$OUT/structured_cost.log" | tee -a "$LOG"
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 240 "$PYTHON" -m pytest -q -m gpu tests/gpu/test_structured_gpu.py \
    tests/kernels/test_decode_state.py >"$OUT/tests.log" 2>&1
  say "gpu tests rc=$? ($(tail -1 "$OUT/tests.log"))"
fi
say "done"
