#!/usr/bin/env bash
# FP8 on one H200, in one call (issue 30; docs/quantization.md). PARTS picks, in this order:
#   matmul    python -m benchmarks.fp8_matmul --gemv --made-rows: Ouro-1.4B's projections on rows
#             that come quantized (as the norms hand them on), fp8 Triton (GEMV, fp8-dot and
#             widening matmuls, every candidate tiling) and cuBLAS fp8 vs bf16 cuBLAS
#             ($OUT/fp8_matmul.jsonl)
#   fp8tests  the fp8 weight paths' GPU tests only (kernels, test_quant, test_quantized_gpu,
#             test_invariance_full_size): ~3 minutes
#   tests     the GPU tests of the fp8 paths: tests/kernels (fp8 KV kernels and fp8 matmuls),
#             tests/gpu/test_quantized_gpu.py, and the structured-output GPU tests
#             (llguidance from a carried wheel: .carry/wheels/llguidance-*.whl)
#   weights   A B B A, bf16 vs fp8 weights (scripts/gpu_ab.sh), 512/128 fixed depth, C = 1 and 128
#   both      A B B A, bf16 vs fp8 weights + fp8 KV, 512/128 fixed depth, C = 128
#   kv        A B B A, bf16 vs fp8 KV, 8192/256 fixed depth, C = 8
#   capacity  1024/512 at C = 48 with reserved KV on a small pool, bf16 vs fp8 KV: how many run
#   budget    python -m benchmarks.step_budget --concurrency 1 with fp8 weights, then bf16: the
#             per-kernel time of one decode loop ($OUT/budget.jsonl); not in the default set
#   table     python -m benchmarks.attention_table --kv-cache-dtype fp8 (Triton; decode 8 and 128
#             rows x 8192, an 8,192-token prefill) ($OUT/table-fp8.md); not in the default set
#   sweep     python -m benchmarks.decode_sweep --kv-cache-dtype fp8 at 1, 8 and 128 rows x 640
#             and 8192 tokens: which decode tiling an fp8 cache wants, the one-row cases included
#             ($OUT/sweep-fp8.md; docs/quantization.md); not in the default set
# Run from the repository root:  OUT=$OUT PARTS="matmul tests" bash scripts/gpu_fp8.sh
# Budget: matmul ~2 min, fp8tests ~3, tests ~5, weights ~2.5, both ~1.5, kv ~3, capacity ~1.5,
# budget ~0.5, table ~0.3, sweep ~2.
set -uo pipefail

OUT="${OUT:-$PWD/fp8-out}"
PYTHON="${PYTHON:-python3}"
PARTS="${PARTS:-matmul fp8tests weights both kv capacity}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
LOG="$OUT/fp8.log"
started=$(date +%s)
say() { echo "== [$(($(date +%s) - started)) s] $*" | tee -a "$LOG"; }
part() { [[ " $PARTS " == *" $1 "* ]]; }
ab() {  # name bench-args b-args
  mkdir -p "$OUT/$1"
  OUT="$OUT/$1" BENCH_ARGS="$2" B_ARGS="$3" LABELS="bf16,$1" timeout 420 bash scripts/gpu_ab.sh \
    >/dev/null 2>&1
  say "$1 rc=$?"
  cat "$OUT/$1/ab.md" 2>/dev/null | tee -a "$LOG"
}

say "git ${LOOPSERVE_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
if part matmul; then
  timeout 300 "$PYTHON" -m benchmarks.fp8_matmul --gemv --made-rows --rows 1,2,3,16,32,64,128,512 \
    --out "$OUT/fp8_matmul.jsonl" >"$OUT/fp8_matmul.log" 2>&1
  say "matmul rc=$?"
  grep '"best"' "$OUT/fp8_matmul.jsonl" | tee -a "$LOG"
fi
if part fp8tests; then
  timeout 300 "$PYTHON" -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
    tests/kernels/test_e4m3.py tests/kernels/test_fp8_matmul.py tests/kernels/test_gemv.py \
    tests/kernels/test_fused_ops.py tests/unit/test_quant.py tests/gpu/test_quantized_gpu.py \
    tests/gpu/test_invariance_full_size.py >"$OUT/fp8tests.log" 2>&1
  say "fp8 tests rc=$? ($(tail -1 "$OUT/fp8tests.log"))"
  grep -E "^(FAILED|ERROR)" "$OUT/fp8tests.log" | head -20 | tee -a "$LOG"
fi
if part tests; then
  wheel=$(ls .carry/wheels/llguidance-*.whl 2>/dev/null | head -1)
  if [ -n "$wheel" ]; then
    pip install -q --no-index --no-deps --target /tmp/pydeps "$wheel" >/dev/null 2>&1
    export PYTHONPATH="$PYTHONPATH:/tmp/pydeps"
  fi
  timeout 300 "$PYTHON" -m pytest -q -m gpu tests/kernels tests/gpu/test_quantized_gpu.py \
    tests/gpu/test_structured_gpu.py -p no:cacheprovider >"$OUT/tests.log" 2>&1
  say "gpu tests rc=$? ($(tail -1 "$OUT/tests.log"))"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20 | tee -a "$LOG"
fi
FIXED="--exits fixed --scheduling refill --graphs on --trials 1"
if part weights; then ab weights "--workload 512/128 --concurrency 1,128 $FIXED" "--quantization fp8"; fi
if part both; then
  ab both "--workload 512/128 --concurrency 128 $FIXED" "--quantization fp8 --kv-cache-dtype fp8"
fi
if part kv; then ab kv "--workload 8192/256 --concurrency 8 $FIXED" "--kv-cache-dtype fp8"; fi
if part capacity; then
  for dtype in auto fp8; do
    timeout 200 "$PYTHON" -m loopserve.entrypoints.cli bench offline --workload 1024/512 \
      --concurrency 48 --kv-allocation reserve $FIXED --warmup-output-len 8 \
      --gpu-memory-utilization 0.26 --max-model-len 2048 --kv-cache-dtype $dtype --device cuda \
      --output "$OUT/capacity-$dtype.jsonl" --summary "$OUT/capacity-$dtype.md" \
      >"$OUT/capacity-$dtype.log" 2>&1
    say "capacity $dtype rc=$?"
    grep "1024/512" "$OUT/capacity-$dtype.md" | tee -a "$LOG"
  done
fi
if part budget; then
  for quantization in fp8 none; do
    timeout 150 "$PYTHON" -m benchmarks.step_budget --concurrency 1 --quantization $quantization \
      --out "$OUT/budget.jsonl" >"$OUT/budget-$quantization.log" 2>&1
    say "budget $quantization rc=$?"
  done
fi
if part table; then
  timeout 60 "$PYTHON" -m benchmarks.attention_table --kv-cache-dtype fp8 --backends triton \
    --rows 8,128 --contexts 8192 --prefill 1x8192 --markdown "$OUT/table-fp8.md" \
    >"$OUT/table-fp8.log" 2>&1
  say "table rc=$?"
  cat "$OUT/table-fp8.md" 2>/dev/null | tee -a "$LOG"
fi
if part sweep; then
  timeout 200 "$PYTHON" -m benchmarks.decode_sweep --kv-cache-dtype fp8 --rows 1,8,128 \
    --contexts 640,8192 --budget-s 150 --out "$OUT/sweep-fp8.jsonl" --tables "$OUT/sweep-fp8.md" \
    >"$OUT/sweep-fp8.log" 2>&1
  say "sweep rc=$?"
  head -30 "$OUT/sweep-fp8.md" 2>/dev/null | tee -a "$LOG"
fi
say "done"
