#!/usr/bin/env bash
# Timed arrivals: `loopserve bench serve` at several Poisson request rates against one
# `loopserve serve` on one GPU, in one call, on the random-weight Ouro-1.4B checkpoint (bf16;
# written once to ~/.cache/loopserve/ouro-1.4b-random by loopserve.bench.checkpoint_cache).
# For each workload (WORKLOADS, "input/output/prompts rates...") and each exit setting (fixed
# depth: `min_loops` = all loops; d2.6: the server's `--exit-mode trace` default distribution)
# it sends the prompts at each rate, untimed warm-up first, and records TTFT / TPOT / ITL
# percentiles and the goodput at GOODPUT (vllm bench serve's `--goodput`); CLOSED="C ..." adds
# closed-loop runs (C in flight, 2 x C requests: `bench offline`'s protocol, to compare). Then
# `python -m benchmarks.rate_table` turns the lines into the table docs/server.md shows (and,
# where matplotlib is installed, the plot: `--plot FILE`, also runnable afterwards on the lines).
#
# Device:  carry the server's wheels (the image has aiohttp but not fastapi, uvicorn, pydantic
#          or jinja2; nothing installs from the network there):
#            mkdir -p .carry/serve && pip download --only-binary=:all: --python-version 3.12 \
#              --platform manylinux2014_x86_64 --implementation cp -d .carry/serve \
#              'fastapi>=0.110' 'pydantic>=2.12' 'uvicorn>=0.29' 'jinja2>=3.1'     (~4 MB)
#          then, carrying `.carry/serve`:  OUT=$OUT SERVE_WHEELS=.carry/serve bash scripts/gpu_serve_rates.sh
# CPU rehearsal (ouro-tiny, tiny sizes, ~2 min on 2 cores):
#          DEVICE=cpu OUT=/tmp/rates bash scripts/gpu_serve_rates.sh
# The server runs its engine in a process of its own (the default);
# SERVE_FLAGS="--no-engine-process" keeps it in a thread of the server.
# Every step has a timeout and the whole run a deadline (DEADLINE_S, default 500 s): a step that
# would start past it is skipped and logged. Writes $OUT/rates.jsonl (one bench serve line per
# run, `config.label` = "<exits> <input>/<output>"), $OUT/rates.md, $OUT/rates.log.
set -euo pipefail

DEVICE="${DEVICE:-cuda}"
OUT="${OUT:-$PWD/rates-out}"
PYTHON="${PYTHON:-python3}"
PORT="${PORT:-8766}"
DEADLINE_S="${DEADLINE_S:-500}"
FIXED_LOOPS="${FIXED_LOOPS:-4}"  # Ouro-1.4B and ouro-tiny both run 4 loops
GOODPUT="${GOODPUT:-ttft:250 tpot:25}"
WARMUP_PROMPTS="${WARMUP_PROMPTS:-8}"  # the untimed wave before each exit setting's runs
CLOSED="${CLOSED:-}"  # closed-loop concurrencies run after the rates (e.g. "128"; none by default)
SERVE_FLAGS="${SERVE_FLAGS:-}"  # more `loopserve serve` flags (e.g. "--no-engine-process")
if [ "$DEVICE" = cpu ]; then
  MODEL="${MODEL:-ouro-tiny}"; WORKLOADS="${WORKLOADS:-64/8/12 2 8;32/32/6 1 4}"
  READY_TIMEOUT_S="${READY_TIMEOUT_S:-120}"; STEP_TIMEOUT_S="${STEP_TIMEOUT_S:-60}"
else
  MODEL="${MODEL:-}"; WORKLOADS="${WORKLOADS:-512/128/64 2 8 16 32;128/1024/16 1 2 4}"
  READY_TIMEOUT_S="${READY_TIMEOUT_S:-180}"; STEP_TIMEOUT_S="${STEP_TIMEOUT_S:-90}"
fi
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
LOG="$OUT/rates.log"
RUNS="$OUT/rates.jsonl"
: >"$RUNS"
started=$(date +%s)
say() { echo "== [$(($(date +%s) - started)) s] $*" | tee -a "$LOG"; }
left() { echo $((DEADLINE_S - ($(date +%s) - started))); }

if ! "$PYTHON" -c "import fastapi, uvicorn, pydantic, jinja2, aiohttp" 2>/dev/null; then
  wheels=("${SERVE_WHEELS:-.carry/serve}"/*.whl)
  if [ ! -e "${wheels[0]}" ]; then
    echo "the server's packages are not importable and SERVE_WHEELS has no wheels;" \
      "see this script's header" | tee -a "$LOG" >&2
    exit 1
  fi
  say "installing ${#wheels[@]} wheels into /tmp/serve-site"
  "$PYTHON" -m pip install -q --no-index --no-deps --target /tmp/serve-site "${wheels[@]}" \
    >>"$LOG" 2>&1
  export PYTHONPATH="$PYTHONPATH:/tmp/serve-site"
fi
if [ -z "$MODEL" ]; then
  MODEL=$("$PYTHON" -c "from loopserve.bench.checkpoint_cache import ensure_random_checkpoint
print(ensure_random_checkpoint())" 2>>"$LOG")
fi
say "model $MODEL on $DEVICE; workloads: $WORKLOADS; goodput $GOODPUT; deadline $DEADLINE_S s"

server_pid=""
stop_server() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid"
    timeout 60 tail --pid="$server_pid" -f /dev/null || kill -KILL "$server_pid" || true
  fi
  server_pid=""
}
# shellcheck source=scripts/lib/server.sh
. "$(dirname "$0")/lib/server.sh"
trap stop_server EXIT

say "loopserve serve --exit-mode trace $SERVE_FLAGS"
"$PYTHON" -m loopserve.entrypoints.cli serve --model "$MODEL" --device "$DEVICE" --port "$PORT" \
  --exit-mode trace --max-num-seqs 256 --max-concurrent-requests 4096 --shutdown-timeout 5 \
  $SERVE_FLAGS >>"$LOG" 2>&1 &
server_pid=$!
if ! waited=$(wait_healthy "$PORT" "$server_pid" "$READY_TIMEOUT_S"); then
  say "server not ready after $waited s (see the log)"
  exit 1
fi
say "ready after $waited s"

bench() {  # label seed input output prompts extra-body [flags...]
  local label=$1 seed=$2 input=$3 output=$4 prompts=$5 extra=$6
  shift 6
  if [ "$(left)" -lt 15 ]; then say "$label $*: skipped (deadline)"; return 0; fi
  local limit=$STEP_TIMEOUT_S
  [ "$(left)" -lt "$limit" ] && limit=$(left)
  # shellcheck disable=SC2086  # GOODPUT is a list of METRIC:MS targets
  timeout "$limit" "$PYTHON" -m loopserve.entrypoints.cli bench serve \
    --base-url "http://127.0.0.1:$PORT" --tokenizer "$MODEL" --label "$label" \
    --num-prompts "$prompts" --input-len "$input" --output-len "$output" --seed "$seed" \
    --extra-body "$extra" --goodput $GOODPUT --output "$RUNS" "$@" >>"$LOG" 2>&1 ||
    say "$label $*: failed or timed out after $limit s (see the log)"
}

seed=0
IFS=';' read -r -a workloads <<<"$WORKLOADS"
for workload in "${workloads[@]}"; do
  read -r shape rates <<<"$workload"
  IFS=/ read -r input output prompts <<<"$shape"
  for exits in fixed d2.6; do
    if [ "$exits" = fixed ]; then extra="{\"min_loops\": $FIXED_LOOPS}"; else extra="{}"; fi
    # an untimed wave first: graphs, compiles and the first pages happen there
    timeout "$STEP_TIMEOUT_S" "$PYTHON" -m loopserve.entrypoints.cli bench serve \
      --base-url "http://127.0.0.1:$PORT" --tokenizer "$MODEL" --num-prompts "$WARMUP_PROMPTS" \
      --max-concurrency "$WARMUP_PROMPTS" --input-len "$input" --output-len 4 --seed 9999 \
      --extra-body "$extra" >>"$LOG" 2>&1 || true
    for rate in $rates; do
      say "$exits $input/$output at $rate requests/s ($prompts prompts)"
      bench "$exits $input/$output" $((seed += 1)) "$input" "$output" "$prompts" "$extra" \
        --request-rate "$rate"
    done
    for c in $CLOSED; do  # closed loop: C in flight, 2 x C requests, as `bench offline` runs
      say "$exits $input/$output closed loop at C=$c"
      bench "$exits $input/$output closed" $((seed += 1)) "$input" "$output" $((2 * c)) "$extra" \
        --max-concurrency "$c"
    done
  done
done
stop_server
say "done"
{
  echo "# Timed arrivals ($DEVICE, $MODEL), goodput at $GOODPUT ms, $(date -u +%F)"
  echo
  "$PYTHON" -m benchmarks.rate_table "$RUNS"
} >"$OUT/rates.md"
cat "$OUT/rates.md"
