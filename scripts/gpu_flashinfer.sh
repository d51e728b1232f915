#!/usr/bin/env bash
# GPU issue 9 (attention backends) on one H200, in one call: installs the carried FlashInfer
# bundle into a temporary directory, builds the FlashInfer JIT modules the tests and the table
# need in one parallel ninja run (in the background, while the Triton GPU tests run), then the
# FlashInfer kernel tests, the engine tests with each FlashInfer backend, and the per-layer
# attention table of every backend (decode rows x context: us and TB/s; prompt prefill: us).
#
# Here (internet):  bash scripts/build_flashinfer_bundle.sh       -> .carry/flashinfer/
# There:            OUT=/path/to/out bash scripts/gpu_flashinfer.sh   (carry `.carry/flashinfer`)
# Parts run in this order; PARTS selects (default: all of them), e.g. PARTS="install table":
#   install   bundle -> temp dir (about 10 s)                      INSTALL_TIMEOUT=60
#   prebuild  FlashInfer JIT modules, background (2-3 min)          PREBUILD_TIMEOUT=240
#   triton    pytest -m gpu $TRITON_TESTS (default the Triton kernel tests; without FlashInfer
#             on the path, so `auto` runs Triton)                     TRITON_TIMEOUT=150 (meanwhile)
#   kernels   pytest -m gpu tests/kernels/test_flashinfer_gpu.py    KERNELS_TIMEOUT=240
#             -k "$KERNELS_FILTER" (default "not extended": 48 tests, 152 s on 2026-12-01 after
#             the prebuild, ~90 s of it in test_ouro_shape[prefill-*]'s CPU reference)
#   engine    pytest -m gpu tests/gpu/test_engine_flashinfer_gpu.py ENGINE_TIMEOUT=200 (159 s)
#   table     python -m benchmarks.attention_table $TABLE_ARGS TABLE_TIMEOUT=90
# By default every FlashInfer module is for head size 128 in bf16 (Ouro's; 5 modules, FA3
# prefill the slowest to build). EXTENDED=1 adds GQA 4 and 8, head size 64 and fp16 (6 more
# modules, a few more minutes).
# Budget: about 6 minutes with the JIT cache empty (each FlashInfer module takes 15 s to a few
# minutes of nvcc; the prebuild overlaps the Triton tests). Every part has its own timeout, so the
# script ends within 10 minutes whatever happens (one device call); a failing part does not stop
# the others, and the table's JSON lines are written as they come.
# Writes in $OUT (default ./flashinfer-out): flashinfer.log (everything), prebuild.log,
# attention_table.jsonl (one JSON line per backend and config), attention_table.md.
# Exits non-zero if any part failed or timed out.
set -uo pipefail

OUT="${OUT:-$PWD/flashinfer-out}"
PYTHON="${PYTHON:-python3}"
BUNDLE="${BUNDLE:-$PWD/.carry/flashinfer}"
PARTS="${PARTS:-install prebuild triton kernels engine table}"
TABLE_ARGS="${TABLE_ARGS:-}"
EXTENDED="${EXTENDED:-0}"
ENGINE_TESTS="tests/gpu/test_engine_flashinfer_gpu.py"
TRITON_TESTS="${TRITON_TESTS:-tests/kernels/test_kernels_gpu.py}"
ENGINE_FILTER="not fp32_engine_equals_reference"  # Triton's fp32 suite (16 engines), no FlashInfer
KERNELS_FILTER="${KERNELS_FILTER:-not extended}"
# The shapes the GPU tests and the table build FlashInfer modules for
# (heads,kv,dim,dtype,block[,kv_dtype]); the fp8 one for FA2's fp8-cache test.
SHAPES=(16,16,128,bfloat16,16 4,2,128,bfloat16,16 16,16,128,bfloat16,16,float8_e4m3fn)
if [ "$EXTENDED" = 1 ]; then
  KERNELS_FILTER="flashinfer"
  SHAPES+=(32,8,128,bfloat16,16 32,4,128,bfloat16,16 8,8,64,bfloat16,16 4,2,64,bfloat16,16
    16,16,128,float16,16)
fi
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PATH="$CUDA_HOME/bin:$PATH"
export PYTHONUNBUFFERED=1
export FLASHINFER_JIT_PREBUILD_MAX_JOBS="${FLASHINFER_JIT_PREBUILD_MAX_JOBS:-12}"  # nvcc of FA3 takes GBs
unset TRITON_INTERPRET
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/flashinfer.log"
: >"$LOG"
rm -f "$OUT/attention_table.jsonl"
SITE="${SITE:-$(mktemp -d /tmp/flashinfer-site.XXXX)}"
mkdir -p "$SITE"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"

wants() { [[ " $PARTS " == *" $1 "* ]]; }

# shellcheck source=scripts/lib/step.sh
. "$(dirname "$0")/lib/step.sh"

# The install, as one command for `step` (a bundle of the trimmed wheel tree + the tvm-ffi wheel).
export BUNDLE SITE PYTHON
INSTALL='set -e
archive=$(ls "$BUNDLE"/flashinfer-*-trimmed.tar.xz)
wheel=$(ls "$BUNDLE"/apache_tvm_ffi-*.whl)
tar -xJf "$archive" -C "$SITE"
"$PYTHON" -m pip install -q --no-index --no-deps --target "$SITE" "$wheel"
"$PYTHON" -c "import time; t = time.time(); import flashinfer
print(\"flashinfer\", flashinfer.__version__, \"imported in %.1f s from\" % (time.time() - t),
      flashinfer.__file__)"'

{
  echo "== environment"
  echo "git ${LOOPSERVE_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}; parts: $PARTS"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PYTHON" -c 'import sys, torch, triton
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__, "gpu", torch.cuda.get_device_name())'
  nvcc --version | tail -1 || true
} 2>&1 | tee -a "$LOG"

if wants install; then step "install the FlashInfer bundle into $SITE" "$LOG" \
  "${INSTALL_TIMEOUT:-60}" \
  bash -c "$INSTALL"; fi

prebuild_pid=""
if wants prebuild; then
  echo "== prebuild in the background ($(date -u +%H:%M:%S)): $OUT/prebuild.log" | tee -a "$LOG"
  shape_args=()
  for shape in "${SHAPES[@]}"; do shape_args+=(--shape "$shape"); done
  timeout --signal=INT --kill-after=20 "${PREBUILD_TIMEOUT:-240}" \
    "$PYTHON" -m loopserve.attention.flashinfer.prebuild --both-decode-kernels \
    "${shape_args[@]}" >"$OUT/prebuild.log" 2>&1 &
  prebuild_pid=$!
fi

# shellcheck disable=SC2086  # TRITON_TESTS is a list of paths
if wants triton; then step "pytest -m gpu $TRITON_TESTS (Triton)" "$LOG" "${TRITON_TIMEOUT:-150}" \
  env PYTHONPATH="$PWD" "$PYTHON" -m pytest -m gpu $TRITON_TESTS -q -rs --durations=5 \
  -p no:cacheprovider; fi

# Every FlashInfer part below would only skip without the package: refuse to report that as a run.
if ! "$PYTHON" -c "import flashinfer" 2>>"$LOG"; then
  echo "== flashinfer does not import from $SITE: the FlashInfer parts are NOT run" | tee -a "$LOG"
  PARTS="" status=1
fi

if [ -n "$prebuild_pid" ]; then
  wait "$prebuild_pid"
  rc=$?
  tail -5 "$OUT/prebuild.log" | tee -a "$LOG"
  echo "== prebuild: exit $rc ($(date -u +%H:%M:%S); a failure only means compiling on use)" \
    | tee -a "$LOG"
fi

if wants kernels; then step "pytest -m gpu tests/kernels/test_flashinfer_gpu.py -k '$KERNELS_FILTER'" \
  "$LOG" "${KERNELS_TIMEOUT:-240}" "$PYTHON" -m pytest -m gpu tests/kernels/test_flashinfer_gpu.py -q \
  -k "$KERNELS_FILTER" -rs --durations=10 -p no:cacheprovider; fi

# shellcheck disable=SC2086  # ENGINE_TESTS is a list of paths
if wants engine; then step "pytest -m gpu $ENGINE_TESTS -k '$ENGINE_FILTER'" "$LOG" \
  "${ENGINE_TIMEOUT:-200}" "$PYTHON" -m pytest -m gpu $ENGINE_TESTS -k "$ENGINE_FILTER" -q -s \
  -rs --durations=10 -p no:cacheprovider; fi

# shellcheck disable=SC2086  # TABLE_ARGS is a list of flags
if wants table; then step "python -m benchmarks.attention_table $TABLE_ARGS" "$LOG" \
  "${TABLE_TIMEOUT:-90}" "$PYTHON" -m benchmarks.attention_table $TABLE_ARGS \
  --out "$OUT/attention_table.jsonl" --markdown "$OUT/attention_table.md"; fi

echo "== done: exit $status ($(date -u +%H:%M:%S))" | tee -a "$LOG"
exit "$status"
