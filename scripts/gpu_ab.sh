#!/usr/bin/env bash
# Before/after on one GPU in one call: `loopserve bench offline` run A B B A, then `loopserve
# bench compare` over the four runs. A and B differ by source tree (A = $BASELINE, a worktree of
# the baseline commit carried beside this tree), by flags (A_ARGS, B_ARGS), or both.
#
# Two commits:   git worktree add .baseline <commit>   (/.baseline/ is git-ignored: name it in
#                `carry`), then there: OUT=$OUT BASELINE=.baseline A_SHA=<c> B_SHA=<c> bash scripts/gpu_ab.sh
# Two settings:  OUT=$OUT A_ARGS="--attention-backend triton" \
#                B_ARGS="--attention-backend flashinfer_fa2" LABELS=triton,flashinfer_fa2 bash scripts/gpu_ab.sh
# Budget: about a minute per run with the default sweep (one trial per run; A B B A gives two
# per side), plus writing the random Ouro-1.4B checkpoint once (10-60 s).
# Writes: $OUT/ab-{A1,B1,B2,A2}.jsonl, $OUT/ab.md (the table), $OUT/ab.log (everything printed).
set -euo pipefail

OUT="${OUT:-$PWD/ab-out}"
BASELINE="$(cd "${BASELINE:-.}" && pwd)"
PYTHON="${PYTHON:-python3}"
BENCH_ARGS="${BENCH_ARGS:---workload 512/128 --concurrency 1,8,32 --exits fixed,d2.6 \
--scheduling refill --graphs on --trials 1}"
A_ARGS="${A_ARGS:-}"
B_ARGS="${B_ARGS:-}"
LABELS="${LABELS:-before,after}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG="$OUT/ab.log"

run_side() {  # name tree sha extra-args
  echo "== $1: $2 (${3:-unknown}) $4" | tee -a "$LOG"
  # shellcheck disable=SC2086  # BENCH_ARGS and the extra args are lists of flags
  (cd "$2" && LOOPSERVE_GIT_SHA="${3:-unknown}" PYTHONPATH="$2${PYTHONPATH:+:$PYTHONPATH}" \
    "$PYTHON" -m loopserve.entrypoints.cli bench offline $BENCH_ARGS $4 --device cuda \
    --output "$OUT/ab-$1.jsonl") >>"$LOG" 2>&1
}

started=$(date +%s)
run_side A1 "$BASELINE" "${A_SHA:-}" "$A_ARGS"
run_side B1 "$PWD" "${B_SHA:-}" "$B_ARGS"
run_side B2 "$PWD" "${B_SHA:-}" "$B_ARGS"
run_side A2 "$BASELINE" "${A_SHA:-}" "$A_ARGS"
echo "== done in $(($(date +%s) - started)) s" | tee -a "$LOG"
PYTHONPATH="$PWD" "$PYTHON" -m loopserve.entrypoints.cli bench compare --labels "$LABELS" \
  --a "$OUT/ab-A1.jsonl" "$OUT/ab-A2.jsonl" --b "$OUT/ab-B1.jsonl" "$OUT/ab-B2.jsonl" \
  --output "$OUT/ab.md"
