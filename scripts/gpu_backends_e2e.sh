#!/usr/bin/env bash
# Attention backends end to end on one GPU, in one call: `loopserve bench offline` with Triton and
# with FlashInfer FA2 (the bench's random Ouro-1.4B checkpoint, bf16, 512/128, C = 1, 32 and 128,
# fixed depth and d2.6, CUDA graphs), alternated A B B A, each run writing its per-step timeline
# (`--step-timeline`), so a difference can be placed: prompt steps or decode steps, host or device.
# What `auto`'s order on SM90 (`attention/registry.py`) and docs/kernels.md are measured by.
#
# Here (internet):  bash scripts/build_flashinfer_bundle.sh       -> .carry/flashinfer/
# There:            OUT=$OUT bash scripts/gpu_backends_e2e.sh      (carry `.carry/flashinfer`)
# Order: install the bundle (~15 s), build FA2's JIT modules for Ouro's shape (2-3 min; nothing
# else runs meanwhile, so no bench shares the host with nvcc), then the benches in ORDER (default
# triton, flashinfer_fa2, flashinfer_fa2, triton: about a minute each), then `bench compare`.
# Writes in $OUT: e2e.log (everything printed), bench-<i>-<backend>.jsonl,
# timeline-<i>-<backend>.jsonl, compare.md. Exits non-zero if a part failed.
set -uo pipefail

OUT="${OUT:-$PWD/backends-out}"
PYTHON="${PYTHON:-python3}"
BUNDLE="${BUNDLE:-$PWD/.carry/flashinfer}"
ORDER="${ORDER:-triton flashinfer_fa2 flashinfer_fa2 triton}"
BENCH_ARGS="${BENCH_ARGS:---workload 512/128 --concurrency 1,32,128 --exits fixed,d2.6 \
--scheduling refill --graphs on --trials 1}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PATH="$CUDA_HOME/bin:$PATH"
export PYTHONUNBUFFERED=1
export FLASHINFER_JIT_PREBUILD_MAX_JOBS="${FLASHINFER_JIT_PREBUILD_MAX_JOBS:-12}"
unset TRITON_INTERPRET
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/e2e.log"
: >"$LOG"
SITE="${SITE:-$(mktemp -d /tmp/flashinfer-site.XXXX)}"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# shellcheck source=scripts/lib/step.sh
. "$(dirname "$0")/lib/step.sh"

echo "== git ${LOOPSERVE_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" | tee -a "$LOG"
step "install the FlashInfer bundle into $SITE" "$LOG" 90 bash -c "set -e
  tar -xJf $BUNDLE/flashinfer-*-trimmed.tar.xz -C $SITE
  $PYTHON -m pip install -q --no-index --no-deps --target $SITE $BUNDLE/apache_tvm_ffi-*.whl
  $PYTHON -c 'import flashinfer; print(\"flashinfer\", flashinfer.__version__)'"
step "prebuild FA2 modules for 16,16,128,bfloat16,16" "$LOG" "${PREBUILD_TIMEOUT:-300}" \
  "$PYTHON" -m loopserve.attention.flashinfer.prebuild --shape 16,16,128,bfloat16,16

a_runs=() b_runs=() index=0
for backend in $ORDER; do
  index=$((index + 1))
  name="$index-$backend"
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
  step "bench offline --attention-backend $backend ($name)" "$LOG" "${BENCH_TIMEOUT:-240}" \
    "$PYTHON" -m loopserve.entrypoints.cli bench offline $BENCH_ARGS --device cuda \
    --attention-backend "$backend" --output "$OUT/bench-$name.jsonl" \
    --step-timeline "$OUT/timeline-$name.jsonl"
  if [ "$backend" = "triton" ]; then a_runs+=("$OUT/bench-$name.jsonl")
  else b_runs+=("$OUT/bench-$name.jsonl"); fi
done
if [ "${#a_runs[@]}" -gt 0 ] && [ "${#b_runs[@]}" -gt 0 ]; then
  step "bench compare" "$LOG" 60 "$PYTHON" -m loopserve.entrypoints.cli bench compare \
    --labels triton,flashinfer_fa2 --a "${a_runs[@]}" --b "${b_runs[@]}" --output "$OUT/compare.md"
fi
echo "== done: exit $status" | tee -a "$LOG"
exit "$status"
