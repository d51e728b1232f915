#!/usr/bin/env bash
# Issue 9 (Triton half) on one H200: the kernel GPU tests (every decode tiling the sweep can pick,
# at Ouro's shape, against the reference and bitwise alone vs. batched), then the decode sweep (the
# old kernel and every candidate tiling/schedule, CUDA-graph replay, rows {1,8,32,128} x context
# {512,640,2048,8192}); with SMALL_TESTS=1 also the small-shape decode tests compiled for CUDA.
#
# Run from the repository root (no install needed):  OUT=/path/to/out bash scripts/gpu_decode_sweep.sh
# Budget: about 5-7 minutes on one H200 including first-time Triton compiles. Each step has its
# own timeout in seconds (TEST_TIMEOUT=270, SWEEP_TIMEOUT=270 with SWEEP_BUDGET=200 s in which
# timings may start; SMALL_TIMEOUT=110 when SMALL_TESTS=1), so it ends within 9.5 minutes.
# SWEEP_ARGS adds flags (e.g. "--rows 1,32 --contexts 640"). A CPU rehearsal of the code path:
#   OUT=/tmp/decode DEVICE=cpu SWEEP_ARGS=--smoke bash scripts/gpu_decode_sweep.sh
#
# Writes in $OUT (default ./decode-out):
#   decode_tests.log          environment, then the pytest runs (-rs: skip reasons, slowest tests)
#   decode_sweep.jsonl        one JSON line per timing, the summary last (bench=decode_sweep_summary)
#   decode_sweep.log          everything the sweep printed: the lines, then the tables
#   decode_sweep_tables.txt   the tables alone (also printed again at the very end)
#   decode_sweep_summary.json the chosen tiling and schedule (paste into decode_plan.py)
# Exits non-zero if any step failed or timed out; later steps run anyway.
set -uo pipefail

OUT="${OUT:-$PWD/decode-out}"
PYTHON="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
SWEEP_ARGS="${SWEEP_ARGS:-}"
TEST_TIMEOUT="${TEST_TIMEOUT:-270}"
SWEEP_TIMEOUT="${SWEEP_TIMEOUT:-270}"
SWEEP_BUDGET="${SWEEP_BUDGET:-200}"
SMALL_TESTS="${SMALL_TESTS:-0}"
SMALL_TIMEOUT="${SMALL_TIMEOUT:-110}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"  # triton >= 3.9 warns if unset
unset TRITON_INTERPRET  # the real compiler on the GPU; the CPU rehearsal's tests set it themselves
mkdir -p "$OUT"
TESTS_LOG="$OUT/decode_tests.log"
SWEEP_LOG="$OUT/decode_sweep.log"
SWEEP_JSONL="$OUT/decode_sweep.jsonl"
TABLES="$OUT/decode_sweep_tables.txt"
rm -f "$SWEEP_JSONL" "$OUT/decode_sweep_summary.json" "$TABLES"
# shellcheck source=scripts/lib/step.sh
. "$(dirname "$0")/lib/step.sh"

{
  echo "== environment"
  echo "git ${LOOPSERVE_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
  "$PYTHON" -c 'import sys, torch, triton, pytest
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__, "pytest", pytest.__version__)
assert sys.argv[1] == "cpu" or torch.cuda.is_available(), "no CUDA device"' "$DEVICE"
} 2>&1 | tee "$TESTS_LOG"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
  echo "environment check failed; nothing run" | tee -a "$TESTS_LOG"
  exit 1
fi
cp "$TESTS_LOG" "$SWEEP_LOG"

step "pytest -m gpu tests/kernels/test_kernels_gpu.py benchmarks/tests/test_sweep_tilings.py" \
  "$TESTS_LOG" "$TEST_TIMEOUT" "$PYTHON" -m pytest -m gpu tests/kernels/test_kernels_gpu.py \
  benchmarks/tests/test_sweep_tilings.py -q -rs --durations=10 -p no:cacheprovider

# shellcheck disable=SC2086  # SWEEP_ARGS is a list of flags
step "python -m benchmarks.decode_sweep $SWEEP_ARGS" "$SWEEP_LOG" "$SWEEP_TIMEOUT" \
  "$PYTHON" -m benchmarks.decode_sweep --budget-s "$SWEEP_BUDGET" --out "$SWEEP_JSONL" \
  --tables "$TABLES" $SWEEP_ARGS
grep '"bench": "decode_sweep_summary"' "$SWEEP_JSONL" > "$OUT/decode_sweep_summary.json" || true

if [ "$SMALL_TESTS" = 1 ]; then
  step "pytest -m 'not gpu' test_paged_decode.py test_sweep_tilings.py (small shapes)" \
    "$TESTS_LOG" "$SMALL_TIMEOUT" "$PYTHON" -m pytest -m "not gpu" \
    tests/kernels/test_paged_decode.py benchmarks/tests/test_sweep_tilings.py -q -rs \
    --durations=5 -p no:cacheprovider
fi

test_results="$(grep -E "(passed|failed|error|deselected) in " "$TESTS_LOG" | grep -v '^[={]')"
{
  echo "== sweep tables and summary (again, so that they end the output)"
  cat "$TABLES" "$OUT/decode_sweep_summary.json" 2>/dev/null || echo "(no sweep tables)"
  echo "== pytest: $test_results"
  echo "== done: exit $status; $(wc -l <"$SWEEP_JSONL" 2>/dev/null || echo 0) sweep records"
} | tee -a "$TESTS_LOG"
exit "$status"
