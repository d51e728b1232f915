# Sourced by the GPU scripts that run `loopserve serve` (not run). `healthy PORT`: whether the
# server on 127.0.0.1:PORT answers /health. `wait_healthy PORT PID LIMIT_S`: waits until it does,
# printing the seconds waited; fails if process PID ends or LIMIT_S passes first. Both use
# $PYTHON (no curl on the GPU image).
# shellcheck shell=bash

healthy() {
  "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
    "http://127.0.0.1:$1/health" 2>/dev/null
}

wait_healthy() {
  local port=$1 pid=$2 limit=$3 waited=0
  until healthy "$port"; do
    if ! kill -0 "$pid" 2>/dev/null || [ "$waited" -ge "$limit" ]; then
      echo "$waited"
      return 1
    fi
    sleep 2
    waited=$((waited + 2))
  done
  echo "$waited"
}
