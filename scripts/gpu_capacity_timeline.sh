#!/usr/bin/env bash
# GPU issue 11 (serving capacity): 1024/512 with KV pages reserved up front vs taken as tokens
# arrive (`--kv-allocation incremental`, preempting), at C = 24 and 40 on a KV cache shrunk by
# --gpu-memory-utilization, with a per-step timeline (`--step-timeline`) of every trial and a
# summary of where the step time went. The first run of this workload found incremental at 0.33x
# reserve at C=40: with max_num_seqs 40 the largest CUDA-graph row bucket was 32, so decode steps
# over 33-40 rows ran eagerly (fixed: the slot count is always a bucket, runner/cuda_graphs.py);
# this script measures the fix. PROFILE_STEPS=START:COUNT adds torch.profiler tables over those
# steps of the trials (PROFILE_STEPS= for none, the default).
# Random-weight Ouro-1.4B (bf16; written once to ~/.cache/loopserve/ouro-1.4b-random), Triton
# attention, CUDA graphs, fixed depth, 2 x C requests per trial, warm-up waves of 8 tokens.
# Run from the repository root:  OUT=/path/to/out bash scripts/gpu_capacity_timeline.sh
# Budget: about 2.5 minutes (checkpoint ~20 s, four trials of 17-30 s, one engine start per mode).
# Writes $OUT/capacity.{jsonl,md}, the timeline $OUT/capacity-steps.jsonl with its summary
# $OUT/capacity-steps-summary.md, and $OUT/timeline.log. `python -m
# loopserve.bench.timeline_summary FILE` summarises a timeline again.
set -euo pipefail

OUT="${OUT:-$PWD/capacity-timeline-out}"
PYTHON="${PYTHON:-python3}"
PROFILE_STEPS="${PROFILE_STEPS:-}"
ARGS="${ARGS:---workload 1024/512 --concurrency 24,40 --exits fixed --scheduling refill --graphs on \
--trials 1 --warmup-output-len 8 --gpu-memory-utilization 0.26 --max-model-len 2048}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

bench() {  # name args...
  local name=$1
  shift
  echo "== bench offline $*" | tee -a "$OUT/timeline.log"
  # shellcheck disable=SC2086  # ARGS is a list of flags
  "$PYTHON" -m loopserve.entrypoints.cli bench offline $ARGS "$@" --device cuda \
    --output "$OUT/$name.jsonl" --summary "$OUT/$name.md" \
    --step-timeline "$OUT/$name-steps.jsonl" 2>&1 | tee -a "$OUT/timeline.log"
}

profile=()
if [ -n "$PROFILE_STEPS" ]; then profile=(--profile-steps "$PROFILE_STEPS"); fi
bench capacity --kv-allocation reserve,incremental "${profile[@]}"
