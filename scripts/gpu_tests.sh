#!/usr/bin/env bash
# The whole GPU test suite (`pytest -m gpu`: tests/ and benchmarks/tests/) over several device
# calls: SHARD=i/N runs the i-th of N contiguous slices of the collected GPU test ids (tests of one
# file stay together, so a slice compiles each kernel once). No single call has held the whole suite (the compiled
# kernel tests alone took more than 100 s for the fp8 files on an H100, and tests/gpu's engines
# more than 300 s for 63 tests), so run it as, say, SHARD=1/3, 2/3 and 3/3 in three calls.
#
# Run from the repository root:  OUT=/path/to/out SHARD=1/3 bash scripts/gpu_tests.sh
# Tests whose extra is missing there skip and say why (FlashInfer: carry and install the bundle
# as scripts/gpu_flashinfer.sh does; structured output: the llguidance wheel, scripts/gpu_fp8.sh).
# Writes in $OUT (default ./gpu-tests-out): ids.txt (every GPU test id), shard-i.txt (this
# slice's), shard-i.log (pytest's report, skip reasons and the slowest tests). TIMEOUT (default
# 540 s) ends pytest within one call; what it did not reach is the slice's tail.
set -uo pipefail

OUT="${OUT:-$PWD/gpu-tests-out}"
PYTHON="${PYTHON:-python3}"
SHARD="${SHARD:-1/1}"
TIMEOUT="${TIMEOUT:-540}"
index="${SHARD%/*}"
count="${SHARD#*/}"
if ! [[ "$index" =~ ^[0-9]+$ && "$count" =~ ^[0-9]+$ ]] || ((index < 1 || index > count)); then
  echo "SHARD must be i/N with 1 <= i <= N, not '$SHARD'" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

"$PYTHON" -m pytest --collect-only -q -m gpu -p no:cacheprovider 2>/dev/null \
  | grep '::' >"$OUT/ids.txt"
total=$(wc -l <"$OUT/ids.txt")
first=$(((index - 1) * total / count + 1))
last=$((index * total / count))
sed -n "${first},${last}p" "$OUT/ids.txt" >"$OUT/shard-$index.txt"
echo "== shard $SHARD: tests $first-$last of $total"
if ((last < first)); then
  echo "== nothing to run"
  exit 0
fi
timeout "$TIMEOUT" "$PYTHON" -m pytest -q -rs --durations=15 -p no:cacheprovider -m gpu \
  $(cat "$OUT/shard-$index.txt") >"$OUT/shard-$index.log" 2>&1
rc=$?
tail -1 "$OUT/shard-$index.log"
grep -E "^(FAILED|ERROR)" "$OUT/shard-$index.log" | head -30
((rc == 124)) && echo "== timed out after $TIMEOUT s: the slice's tail did not run"
exit "$rc"
