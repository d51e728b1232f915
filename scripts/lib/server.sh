# Sourced by the GPU scripts that run `loopserve serve` (not run). `healthy PORT`: whether the
# server on 127.0.0.1:PORT answers /health. `wait_healthy PORT PID LIMIT_S`: waits until it does,
# printing the seconds waited; fails if process PID ends or LIMIT_S passes first.
# `serve_and_chat MODEL_DIR PORT LOG`: installs the carried `.carry/serve` wheels if the server's
# packages are missing, starts `loopserve serve` with no sizing flags, sends one chat request
# once it is healthy, stops it, and prints one line saying how that went (the server's output
# and the reply go to LOG). All use $PYTHON (no curl on the GPU image).
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

serve_and_chat() {
  local model_dir=$1 port=$2 log=$3 server waited
  if ! "$PYTHON" -c "import fastapi, uvicorn, pydantic, jinja2" 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --target /tmp/serve-site .carry/serve/*.whl \
      >>"$log" 2>&1
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/serve-site"
  fi
  "$PYTHON" -m loopserve.entrypoints.cli serve --model "$model_dir" --port "$port" \
    >>"$log" 2>&1 &
  server=$!
  if waited=$(wait_healthy "$port" "$server" 150); then
    "$PYTHON" - "$port" >>"$log" 2>&1 <<'PY'
import json, sys, urllib.request
body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
request = urllib.request.Request(
    f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions", json.dumps(body).encode(),
    {"Content-Type": "application/json"},
)
print("chat:", urllib.request.urlopen(request, timeout=90).read().decode())
PY
    echo "serve healthy after ${waited} s; $(grep -c 'chat:' "$log") chat reply"
  else
    echo "serve did not become healthy (${waited} s)"
  fi
  kill "$server" 2>/dev/null
  wait "$server" 2>/dev/null
}
