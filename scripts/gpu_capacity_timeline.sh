#!/usr/bin/env bash
# GPU issue 11 (serving capacity): why 1024/512 at C=40 with KV pages taken as tokens arrive
# (`--kv-allocation incremental`, preempting) ran at 0.33x the throughput of `reserve` on one H200.
# Every run writes a per-step timeline (`--step-timeline`) and prints where the step time went:
#   1. incremental, as in scripts/gpu_capacity.sh (max_num_seqs = C = 40), with torch.profiler over
#      PROFILE_STEPS (START:COUNT) of its trial;
#   2. reserve (the baseline) and, unless BUCKET_CHECK=0, in the same process incremental again,
#      both with --max-num-seqs 48. With max_num_seqs 40 the largest CUDA-graph row bucket is 32
#      (runner/cuda_graphs.py), so a decode step over 33..40 rows runs eagerly; with 48 slots those
#      rows replay the 48-row graph (reserve never runs more than 27). If this incremental run
#      gets back to reserve's step time, eager steps were the cause.
# Random-weight Ouro-1.4B (bf16; written once to ~/.cache/loopserve/ouro-1.4b-random), Triton
# attention, CUDA graphs, fixed depth, 2 x C requests per trial, warm-up waves of 8 tokens.
# Run from the repository root:  OUT=/path/to/out bash scripts/gpu_capacity_timeline.sh
# Budget: about 3 minutes with BUCKET_CHECK=0 (checkpoint ~20 s, trials of about 85 and 28 s), about
# 4 with the check (one more engine and a trial of 30-85 s).
# Writes $OUT/{incremental,reserve}.{jsonl,md}, the timelines $OUT/*-steps.jsonl with their
# summaries $OUT/*-steps-summary.md, the profile $OUT/incremental-steps-profile.txt, and
# $OUT/timeline.log. `python -m loopserve.bench.timeline_summary FILE` summarises a timeline again.
set -euo pipefail

OUT="${OUT:-$PWD/capacity-timeline-out}"
PYTHON="${PYTHON:-python3}"
PROFILE_STEPS="${PROFILE_STEPS:-1500:30}"
BUCKET_CHECK="${BUCKET_CHECK:-1}"
ARGS="${ARGS:---workload 1024/512 --concurrency 40 --exits fixed --scheduling refill --graphs on \
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

bench incremental --kv-allocation incremental --profile-steps "$PROFILE_STEPS"
if [[ "$BUCKET_CHECK" == 1 ]]; then
  bench reserve --kv-allocation reserve,incremental --max-num-seqs 48
else
  bench reserve --kv-allocation reserve
fi
