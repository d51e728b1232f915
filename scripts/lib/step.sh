# Sourced by the GPU scripts (not run): `step NAME LOG TIMEOUT COMMAND...` runs COMMAND under its
# own timeout (SIGINT, then SIGKILL 20 s later), appends what it prints to LOG between two
# `== NAME` lines and sets `status=1` if it failed or timed out, so that one failing part does
# not stop the others and the script still exits non-zero.
# shellcheck shell=bash
status=0

step() {
  local name="$1" log="$2" limit="$3"
  shift 3
  echo "== $name ($(date -u +%H:%M:%S), timeout ${limit}s)" | tee -a "$log"
  timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc="${PIPESTATUS[0]}"
  echo "== $name: exit $rc" | tee -a "$log"
  if [ "$rc" -ne 0 ]; then status=1; fi
}
