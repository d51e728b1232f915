#!/usr/bin/env bash
# GPU issue 3: the offline matched-protocol table (`loopserve bench offline --preset issue3`) on
# one H200, on a random-weight Ouro-1.4B checkpoint that the command writes itself (bf16, cached in
# ~/.cache/loopserve/ouro-1.4b-random; about 10-60 s the first time on a machine).
#
# Run from the repository root (no install needed):  OUT=/path/to/out bash scripts/gpu_bench.sh
# Budget: about 6-7 minutes on one H200; the preset skips configurations not started within 480 s
# (override with BENCH_ARGS="--preset issue3 --time-budget 540").
# Pass the commit when the tree has no .git:  LOOPSERVE_GIT_SHA=<sha> OUT=... bash scripts/gpu_bench.sh
# A CPU rehearsal of the same code path (tiny checkpoint from `loopserve make-checkpoint`):
#   OUT=/tmp/bench DEVICE=cpu BENCH_ARGS="--model /tmp/tiny --workload 32/8 --concurrency 1,2
#   --trials 1" bash scripts/gpu_bench.sh
#
# Writes:
#   $OUT/offline.jsonl            one JSON line per record ("floor", then one "offline" per config)
#   $OUT/offline_summary.md       the markdown table, ratios within the run, the targets
#   $OUT/offline_throughput.png   output tok/s vs concurrency
#   $OUT/bench.log                environment, progress and everything printed
# Exits non-zero if the benchmark fails or measures nothing.
set -euo pipefail

OUT="${OUT:-$PWD/bench-out}"
PYTHON="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
BENCH_ARGS="${BENCH_ARGS:---preset issue3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
LOG="$OUT/bench.log"

loopserve() {
  "$PYTHON" -m loopserve.entrypoints.cli "$@"
}

{
  echo "== environment"
  echo "git ${LOOPSERVE_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader \
    || true
  "$PYTHON" -c 'import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
assert sys.argv[1] == "cpu" or torch.cuda.is_available(), "no CUDA device"' "$DEVICE"
} 2>&1 | tee "$LOG"

echo "== bench offline $BENCH_ARGS" | tee -a "$LOG"
started=$(date +%s)
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
loopserve bench offline $BENCH_ARGS --device "$DEVICE" \
  --output "$OUT/offline.jsonl" --summary "$OUT/offline_summary.md" \
  --plot "$OUT/offline_throughput.png" 2>&1 | tee -a "$LOG"
echo "== done in $(($(date +%s) - started)) s" | tee -a "$LOG"
test -s "$OUT/offline.jsonl" && test -s "$OUT/offline_summary.md" && test -s "$OUT/offline_throughput.png"
