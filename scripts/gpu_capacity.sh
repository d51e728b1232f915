#!/usr/bin/env bash
# GPU issue 11 (serving capacity) on one H200, on the random-weight Ouro-1.4B checkpoint the
# benchmark writes itself (bf16; cached in ~/.cache/loopserve/ouro-1.4b-random):
#   1. 512/128 requests sharing a 384-token prefix at C=128, prefix caching on and off (one run);
#   2. 1024/512 at rising C with KV pages reserved up front vs taken as tokens arrive (with
#      preemption, swapping or recomputing the victims' K/V), on a KV cache shrunk by
#      --gpu-memory-utilization so the limit shows at small C.
# Run from the repository root:  OUT=/path/to/out bash scripts/gpu_capacity.sh
# PARTS selects (default "prefix capacity"). TIMELINE=1 gives every run a per-step timeline
# (`--step-timeline`: $OUT/NAME-steps.jsonl and its summary; docs/serving-capacity.md), and
# PROFILE_STEPS=START:COUNT adds torch.profiler tables over those steps. Issue 11's timeline run
# (about 2.5 minutes):  OUT=/path/to/out PARTS=capacity TIMELINE=1 bash scripts/gpu_capacity.sh
# Budget: about 5 minutes. Writes $OUT/prefix.{jsonl,md}, $OUT/capacity.{jsonl,md}, $OUT/capacity.log
set -euo pipefail

OUT="${OUT:-$PWD/capacity-out}"
PYTHON="${PYTHON:-python3}"
PREFIX_ARGS="${PREFIX_ARGS:---workload 512/128 --shared-prefix 384 --concurrency 128 \
--prefix-caching on,off --exits fixed --scheduling refill --graphs on --trials 1 \
--warmup-output-len 8}"
CAPACITY_ARGS="${CAPACITY_ARGS:---workload 1024/512 --concurrency 24,40 \
--kv-allocation reserve,incremental --preemption-mode swap,recompute,auto --exits fixed \
--scheduling refill --graphs on --trials 1 \
--warmup-output-len 8 --gpu-memory-utilization 0.26 --max-model-len 2048}"
PARTS="${PARTS:-prefix capacity}"
TIMELINE="${TIMELINE:-0}"
PROFILE_STEPS="${PROFILE_STEPS:-}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

bench() {  # name args...
  local name=$1
  shift
  local extra=()
  if [ "$TIMELINE" = 1 ]; then extra+=(--step-timeline "$OUT/$name-steps.jsonl"); fi
  if [ -n "$PROFILE_STEPS" ]; then extra+=(--profile-steps "$PROFILE_STEPS"); fi
  echo "== bench offline $* ${extra[*]}" | tee -a "$OUT/capacity.log"
  "$PYTHON" -m loopserve.entrypoints.cli bench offline "$@" "${extra[@]}" --device cuda \
    --output "$OUT/$name.jsonl" --summary "$OUT/$name.md" 2>&1 | tee -a "$OUT/capacity.log"
}

# shellcheck disable=SC2086  # the ARGS variables are lists of flags
if [[ " $PARTS " == *" prefix "* ]]; then bench prefix $PREFIX_ARGS; fi
# shellcheck disable=SC2086
if [[ " $PARTS " == *" capacity "* ]]; then bench capacity $CAPACITY_ARGS; fi
