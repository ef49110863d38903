#!/usr/bin/env bash
# Builds the Python package's wheel: one abi3 wheel for CPython 3.9 and later, with maturin from
# PyPI in pip's isolated build environment (PEP 517), so nothing but a Rust toolchain and a Python
# with pip is needed. Prints the wheel's path; the test setup installs what it prints.
#
#   scripts/build-wheel.sh [OUT_DIR]      (default dist/; PYTHON= picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
PYTHON=${PYTHON:-python3}
mkdir -p "$out"
rm -f "$out"/recsys-*.whl
"$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$out" ./python >&2
if ! wheel=$(compgen -G "$out/recsys-*-cp39-abi3-*.whl"); then
  echo "error: the recsys wheel is not an abi3 wheel for CPython 3.9+: $(ls "$out")" >&2
  exit 1
fi
echo "$wheel"
