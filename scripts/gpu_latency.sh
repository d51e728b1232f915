#!/usr/bin/env bash
# GPU issue 10 (single-stream latency) on one H200, in one call. Baseline = a worktree of the
# commit before the change, git-ignored and carried beside the tree:
#   git worktree add .baseline <commit>    then, carrying `.baseline`:
#   OUT=$OUT BASELINE=.baseline bash scripts/gpu_latency.sh
# Parts run in this order; PARTS selects (default: tests budget ab ttft), each under a timeout:
#   tests   pytest -m "gpu or not gpu" $TESTS: the fused step kernels (their CPU tests compiled
#           for CUDA, and their GPU tests in bf16, eager and graphed), the engine suite (fp32 ==
#           serial reference, bf16 alone == in a batch, graphs == eager, no sync)
#   budget  python -m benchmarks.step_budget --concurrency $BUDGET_C, baseline and this tree,
#           A B B A (BUDGET_PHASES="A1:<tree> B1:<tree>" for fewer): one loop's per-kernel budget
#   ab      scripts/gpu_ab.sh, baseline (A) against this tree (B): $AB_ARGS (decode throughput
#           and TPOT at C=1, 8, 32, fixed depth and d2.6)
#   ttft    scripts/gpu_ab.sh again on one 1024-token prompt at a time: $TTFT_ARGS
#   invariant  (not in the default PARTS) the batch_invariant setting: its kernel, engine and
#           full-size GPU tests, python -m benchmarks.invariant_matmul, the full-size
#           alone-vs-batch probe with the setting on, and gpu_ab.sh of this tree default against
#           --batch-invariant: $INVARIANT_ARGS (no baseline needed)
# Writes in $OUT: latency.log (everything), budget-{A1,B1,B2,A2}.jsonl,
# ab/ and ttft/ (gpu_ab.sh's files). Exits non-zero if a part failed or timed out.
set -uo pipefail

OUT="${OUT:-$PWD/latency-out}"
PYTHON="${PYTHON:-python3}"
BASELINE="$(cd "${BASELINE:-.baseline}" 2>/dev/null && pwd)"  # unused by `invariant`
PARTS="${PARTS:-tests budget ab ttft}"
TESTS="${TESTS:-tests/kernels/test_decode_state.py tests/gpu/test_engine_gpu.py}"
BUDGET_C="${BUDGET_C:-1,32}"
AB_ARGS="${AB_ARGS:---workload 512/128 --concurrency 1,8,32 --exits fixed,d2.6 --scheduling refill \
--graphs on --trials 1}"
TTFT_ARGS="${TTFT_ARGS:---workload 1024/8 --concurrency 1 --exits fixed \
--graphs on --trials 1 --warmup-output-len 8}"
INVARIANT_ARGS="${INVARIANT_ARGS:---workload 512/128 --concurrency 1,128 --exits fixed \
--scheduling refill --graphs on --trials 1}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/latency.log"
: >"$LOG"

wants() { [[ " $PARTS " == *" $1 "* ]]; }

# shellcheck source=scripts/lib/step.sh
. "$(dirname "$0")/lib/step.sh"

echo "== git $(git rev-parse --short HEAD 2>/dev/null || echo unknown), baseline" \
  "$(git -C "$BASELINE" rev-parse --short HEAD 2>/dev/null || echo unknown); parts: $PARTS" \
  | tee -a "$LOG"

# shellcheck disable=SC2086  # TESTS is a list of paths
if wants tests; then step "pytest $TESTS" "$LOG" "${TESTS_TIMEOUT:-300}" \
  env PYTHONPATH="$PWD" "$PYTHON" -m pytest -m "gpu or not gpu" $TESTS -q -rs --durations=5 \
  -p no:cacheprovider; fi

if wants budget; then
  for phase in ${BUDGET_PHASES:-A1:$BASELINE B1:$PWD B2:$PWD A2:$BASELINE}; do
    name="${phase%%:*}" tree="${phase#*:}"
    step "step_budget $name ($tree)" "$LOG" "${BUDGET_TIMEOUT:-90}" bash -c "cd '$tree' &&
      PYTHONPATH='$tree' '$PYTHON' -m benchmarks.step_budget --concurrency $BUDGET_C \
      --out '$OUT/budget-$name.jsonl'"
  done
fi

if wants ab; then step "gpu_ab.sh $AB_ARGS" "$LOG" "${AB_TIMEOUT:-400}" env OUT="$OUT/ab" \
  BASELINE="$BASELINE" BENCH_ARGS="$AB_ARGS" bash scripts/gpu_ab.sh; fi

if wants ttft; then step "gpu_ab.sh $TTFT_ARGS" "$LOG" "${TTFT_TIMEOUT:-200}" env OUT="$OUT/ttft" \
  BASELINE="$BASELINE" BENCH_ARGS="$TTFT_ARGS" bash scripts/gpu_ab.sh; fi

# shellcheck disable=SC2086  # INVARIANT_ARGS is a list of flags
if wants invariant; then
  step "batch_invariant tests" "$LOG" "${TESTS_TIMEOUT:-300}" env PYTHONPATH="$PWD" "$PYTHON" \
    -m pytest -m "gpu or not gpu" tests/kernels/test_matmul.py tests/gpu/test_engine_gpu.py \
    tests/gpu/test_invariance_full_size.py -q -rs -p no:cacheprovider
  step "invariant_matmul" "$LOG" 120 env PYTHONPATH="$PWD" "$PYTHON" \
    -m benchmarks.invariant_matmul --out "$OUT/invariant_matmul.jsonl"
  step "gpu_ab.sh default vs --batch-invariant" "$LOG" "${AB_TIMEOUT:-400}" env \
    OUT="$OUT/invariant" B_ARGS="--batch-invariant" LABELS=default,batch_invariant \
    BENCH_ARGS="$INVARIANT_ARGS" bash scripts/gpu_ab.sh
fi

echo "== done: exit $status ($(date -u +%H:%M:%S))" | tee -a "$LOG"
exit "$status"
