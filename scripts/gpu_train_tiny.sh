#!/usr/bin/env bash
# Train the built-in tiny looped model on one GPU, evaluate it, and leave everything in $OUT.
#
# Run from the repository root (no install needed):  OUT=/path/to/out bash scripts/gpu_train_tiny.sh
# Budget: about 2 minutes on one H200 (44 s of training; stage 1 is capped at TRAIN_SECONDS).
# A CPU rehearsal of the same code path:
#   OUT=/tmp/out DEVICE=cpu TRAIN_ARGS=--small EVAL_MAX_TOKENS=2048 bash scripts/gpu_train_tiny.sh
#
# Writes exactly 8 files:
#   $OUT/ouro-tiny/config.json, generation_config.json, model.safetensors, tokenizer.json,
#                  training_info.json      -> copy all five into loopserve/assets/ouro-tiny/
#   $OUT/train.log                          (environment, training progress, curve, samples)
#   $OUT/eval_curve.json, $OUT/eval_curve.png   (held-out perplexity vs exit threshold)
set -euo pipefail

: "${OUT:?set OUT to the output directory}"
PYTHON="${PYTHON:-python3}"
TRAIN_SECONDS="${TRAIN_SECONDS:-180}"
DEVICE="${DEVICE:-cuda}"
TRAIN_ARGS="${TRAIN_ARGS:-}"
EVAL_MAX_TOKENS="${EVAL_MAX_TOKENS:-0}"  # 0: every held-out token
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
LOG="$OUT/train.log"

loopserve() {
  "$PYTHON" -c 'import sys; from loopserve.entrypoints.cli import main; sys.exit(main())' "$@"
}

{
  echo "== environment"
  git rev-parse HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PYTHON" -c 'import sys, sysconfig, torch, tokenizers, safetensors
print("python", sys.version.split()[0], "stdlib", sysconfig.get_paths()["stdlib"])
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "tokenizers",
      tokenizers.__version__, "safetensors", safetensors.__version__)
assert sys.argv[1] == "cpu" or torch.cuda.is_available(), "no CUDA device"' "$DEVICE"
} 2>&1 | tee "$LOG"

echo "== train-tiny" | tee -a "$LOG"
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of flags
loopserve train-tiny "$OUT/ouro-tiny" --device "$DEVICE" --time-limit "$TRAIN_SECONDS" $TRAIN_ARGS \
  2>&1 | tee -a "$LOG"

echo "== eval perplexity (all held-out tokens)" | tee -a "$LOG"
loopserve eval perplexity --model "$OUT/ouro-tiny" --device "$DEVICE" --batch-size 64 \
  --max-tokens "$EVAL_MAX_TOKENS" \
  --output "$OUT/eval_curve.json" --plot "$OUT/eval_curve.png" 2>&1 | tee -a "$LOG"

# Samples through the engine on the CPU; a failure here must not lose the model above.
echo "== samples (greedy, fixed depth, then exit threshold 0.5)" | tee -a "$LOG"
for threshold in 1.0 0.5; do
  loopserve generate --model "$OUT/ouro-tiny" --device cpu --max-tokens 64 \
    --exit-threshold "$threshold" \
    --prompt $'def fibonacci(n):\n    ' \
    --prompt $'import os\n\n\ndef list_python_files(directory):\n    ' \
    --prompt $'class Stack:\n    """A last-in first-out stack."""\n\n    def __init__(self):\n' \
    2>&1 | tee -a "$LOG" || echo "generate failed (the model above is unaffected)" | tee -a "$LOG"
done
echo "== done" | tee -a "$LOG"
