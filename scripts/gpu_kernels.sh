#!/usr/bin/env bash
# GPU issue, part 1: the Triton attention kernels on one H200. Realistic-size correctness tests
# (`pytest -m gpu tests/kernels`), then the kernel benchmark (`python -m benchmarks.kernel_bench`),
# then the small-shape kernel tests compiled for CUDA (the ones CPU CI runs in the interpreter).
#
# Run from the repository root (no install needed):  OUT=/path/to/out bash scripts/gpu_kernels.sh
# Budget: about 4-6 minutes on one H200, first-time Triton compiles included. Each step has its
# own timeout in seconds (TEST_TIMEOUT=200, BENCH_TIMEOUT=220, SMALL_TIMEOUT=120), so the script
# ends within about 9 minutes whatever happens. BENCH_ARGS="--quick" runs fewer configs.
# A CPU rehearsal of the same code path (GPU tests skip, benchmark on tiny shapes):
#   OUT=/tmp/kernels DEVICE=cpu BENCH_ARGS=--smoke bash scripts/gpu_kernels.sh
#
# Writes three files in $OUT (default ./kernels-out):
#   kernels_tests.log     environment, then both pytest runs (-rs: skip reasons, slowest tests)
#   kernels_bench.jsonl   one JSON line per benchmark config (see benchmarks/kernel_bench.py)
#   kernels_bench.log     everything the benchmark printed, errors included
# Exits non-zero if any step failed or timed out; later steps run anyway.
set -uo pipefail

OUT="${OUT:-$PWD/kernels-out}"
PYTHON="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
BENCH_ARGS="${BENCH_ARGS:-}"
TEST_TIMEOUT="${TEST_TIMEOUT:-200}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-220}"
SMALL_TIMEOUT="${SMALL_TIMEOUT:-120}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # the real compiler on the GPU; the CPU rehearsal's tests set it themselves
mkdir -p "$OUT"
TESTS_LOG="$OUT/kernels_tests.log"
BENCH_LOG="$OUT/kernels_bench.log"
BENCH_JSONL="$OUT/kernels_bench.jsonl"
rm -f "$BENCH_JSONL"
# shellcheck source=scripts/lib/step.sh
. "$(dirname "$0")/lib/step.sh"

{
  echo "== environment"
  echo "git ${LOOPSERVE_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PYTHON" -c 'import sys, torch, triton, pytest
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__, "pytest", pytest.__version__)
assert sys.argv[1] == "cpu" or torch.cuda.is_available(), "no CUDA device"' "$DEVICE"
} 2>&1 | tee "$TESTS_LOG"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
  echo "environment check failed; nothing run" | tee -a "$TESTS_LOG"
  exit 1
fi
cp "$TESTS_LOG" "$BENCH_LOG"

step "pytest -m gpu tests/kernels" "$TESTS_LOG" "$TEST_TIMEOUT" \
  "$PYTHON" -m pytest -m gpu tests/kernels -q -rs --durations=10 -p no:cacheprovider

# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
step "python -m benchmarks.kernel_bench $BENCH_ARGS" "$BENCH_LOG" "$BENCH_TIMEOUT" \
  "$PYTHON" -m benchmarks.kernel_bench $BENCH_ARGS --out "$BENCH_JSONL"

step "pytest -m 'not gpu' tests/kernels (small shapes)" "$TESTS_LOG" "$SMALL_TIMEOUT" \
  "$PYTHON" -m pytest -m "not gpu" tests/kernels -q -rs --durations=5 -p no:cacheprovider

echo "== done: exit $status; $(wc -l <"$BENCH_JSONL" 2>/dev/null || echo 0) benchmark records" \
  | tee -a "$TESTS_LOG"
exit "$status"
