#!/usr/bin/env bash
# Before/after on one GPU in one call: `loopserve bench offline` from two source trees, run
# A B B A (A = $BASELINE, a worktree of the baseline commit carried beside this tree; B = this
# tree), then `loopserve bench compare` over the four runs.
#
# Here:   git worktree add .baseline <commit>     (/.baseline/ is git-ignored: name it in `carry`)
# There:  OUT=$OUT BASELINE=.baseline A_SHA=<commit> B_SHA=<commit> bash scripts/gpu_ab.sh
# Budget: about a minute per run with the default sweep (one trial per run; A B B A gives two
# per side), plus writing the random Ouro-1.4B checkpoint once (10-60 s).
# Writes: $OUT/ab-{A1,B1,B2,A2}.jsonl, $OUT/ab.md (the table), $OUT/ab.log (everything printed).
set -euo pipefail

OUT="${OUT:-$PWD/ab-out}"
BASELINE="$(cd "${BASELINE:?set BASELINE to the baseline tree}" && pwd)"
PYTHON="${PYTHON:-python3}"
BENCH_ARGS="${BENCH_ARGS:---workload 512/128 --concurrency 1,8,32 --exits fixed,d2.6 \
--scheduling refill --graphs on --trials 1}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG="$OUT/ab.log"

run_side() {  # name tree sha
  echo "== $1: $2 (${3:-unknown})" | tee -a "$LOG"
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
  (cd "$2" && LOOPSERVE_GIT_SHA="${3:-unknown}" PYTHONPATH="$2" \
    "$PYTHON" -m loopserve.entrypoints.cli bench offline $BENCH_ARGS --device cuda \
    --output "$OUT/ab-$1.jsonl") >>"$LOG" 2>&1
}

started=$(date +%s)
run_side A1 "$BASELINE" "${A_SHA:-}"
run_side B1 "$PWD" "${B_SHA:-}"
run_side B2 "$PWD" "${B_SHA:-}"
run_side A2 "$BASELINE" "${A_SHA:-}"
echo "== done in $(($(date +%s) - started)) s" | tee -a "$LOG"
PYTHONPATH="$PWD" "$PYTHON" -m loopserve.entrypoints.cli bench compare --labels before,after \
  --a "$OUT/ab-A1.jsonl" "$OUT/ab-A2.jsonl" --b "$OUT/ab-B1.jsonl" "$OUT/ab-B2.jsonl" \
  --output "$OUT/ab.md"
