#!/usr/bin/env bash
# Builds the FlashInfer bundle the GPU scripts carry to a machine without internet, reproducibly
# from the pinned PyPI wheels: the flashinfer-python wheel unpacked and trimmed of kernel *sources*
# that paged attention never compiles (every Python module is kept, so `import flashinfer` works
# unchanged), packed as a tar.xz with fixed names, order, owners and times; and the cp312
# manylinux x86_64 apache-tvm-ffi wheel it needs, as downloaded.
#
# Usage (from the repository root, with internet to PyPI):
#   bash scripts/build_flashinfer_bundle.sh            # writes .carry/flashinfer/ (git-ignored)
#   OUT=/some/dir bash scripts/build_flashinfer_bundle.sh
# Then carry `.carry/flashinfer` to the GPU machine; scripts/gpu_flashinfer.sh installs it with
#   tar -xJf flashinfer-*.tar.xz -C DIR && pip install --no-index --no-deps --target DIR tvm.whl
# and runs with PYTHONPATH=DIR. Prints the sizes and sha256 of what it wrote.
set -euo pipefail
umask 022  # file modes in the tar do not depend on the caller

FLASHINFER_VERSION="${FLASHINFER_VERSION:-0.7.2.post1}"
TVM_FFI_VERSION="${TVM_FFI_VERSION:-0.1.15.post2}"  # flashinfer 0.7.2 needs >=0.1.11,<0.2
OUT="${OUT:-$PWD/.carry/flashinfer}"
PYTHON="${PYTHON:-python3}"
# Kernel sources paged attention does not use. Not trimmed: data/cutlass/tools (1 MB), whose
# util/include holds the cutlass/util headers FA3 prefill includes (via cutlass_utils.cuh).
TRIM=(
  "flashinfer/data/csrc/cake_*"
  "flashinfer/data/csrc/kda"
  "flashinfer/data/csrc/fused_moe"
  "flashinfer/data/csrc/gdn"
  "flashinfer/data/csrc/experimental"
  "flashinfer/data/csrc/blackwell_*"
  "flashinfer/data/cutlass/examples"
  "flashinfer/data/cutlass/python"
  "flashinfer/data/cutlass/test"
)

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "== downloading flashinfer-python==$FLASHINFER_VERSION and apache-tvm-ffi==$TVM_FFI_VERSION"
"$PYTHON" -m pip download -q --no-deps --dest "$work/wheels" \
  "flashinfer-python==$FLASHINFER_VERSION"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --dest "$work/wheels" \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  "apache-tvm-ffi==$TVM_FFI_VERSION"
flashinfer_wheel="$(ls "$work"/wheels/flashinfer_python-*.whl)"
tvm_wheel="$(ls "$work"/wheels/apache_tvm_ffi-*.whl)"

echo "== unpacking and trimming $(basename "$flashinfer_wheel")"
mkdir "$work/tree"
"$PYTHON" -m zipfile -e "$flashinfer_wheel" "$work/tree"
before="$(du -sm "$work/tree" | cut -f1)"
(
  cd "$work/tree"
  for pattern in "${TRIM[@]}"; do
    # shellcheck disable=SC2086  # the pattern is meant to glob
    matches=($pattern)
    if [ ! -e "${matches[0]}" ]; then
      echo "trim pattern matched nothing: $pattern (a different wheel layout?)" >&2
      exit 1
    fi
    rm -rf "${matches[@]}"
  done
)
after="$(du -sm "$work/tree" | cut -f1)"
echo "unpacked: ${before} MB, trimmed: ${after} MB"

bundle="$OUT/flashinfer-$FLASHINFER_VERSION-trimmed.tar.xz"
echo "== packing $(basename "$bundle") (xz -9, one thread: the same bytes every time)"
rm -f "$OUT"/flashinfer-*-trimmed.tar.xz "$OUT"/apache_tvm_ffi-*.whl
tar -C "$work/tree" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
  --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
  -cf - . | xz -9 -T1 >"$bundle"
cp "$tvm_wheel" "$OUT/"

echo "== wrote"
(cd "$OUT" && for file in flashinfer-*-trimmed.tar.xz apache_tvm_ffi-*.whl; do
  printf '%-72s %6.1f MB  %s\n' "$file" "$(($(stat -c %s "$file") / 1000))e-3" \
    "$(sha256sum "$file" | cut -c1-16)"
done)
echo "(the original wheel: $(($(stat -c %s "$flashinfer_wheel") / 1000000)) MB)"
