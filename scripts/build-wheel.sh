#!/usr/bin/env bash
# Builds the Python package's wheel: one abi3 wheel for CPython 3.9 and later, with maturin from
# PyPI in pip's isolated build environment (PEP 517), so nothing but a Rust toolchain and a Python
# with pip is needed. Prints the wheel's path; the test setup installs what it prints.
#
#   scripts/build-wheel.sh [--cuda 12|13] [OUT_DIR]   (default dist/; PYTHON= picks the interpreter)
#
# --cuda 12|13: with the GPU path (`recsys.Engine(path, device="cuda")`, and recsys.ray's
# num_gpus actors) for a machine with that CUDA major version's driver and NVRTC; the package
# still loads and runs on the CPU without them.
set -euo pipefail
cd "$(dirname "$0")/.."
features=""
if [[ "${1:-}" == "--cuda" ]]; then
  case "${2:-}" in
    12 | 13) features="cuda-$2" ;;
    *) echo "usage: scripts/build-wheel.sh [--cuda 12|13] [OUT_DIR]" >&2; exit 2 ;;
  esac
  shift 2
fi
out=${1:-dist}
PYTHON=${PYTHON:-python3}
mkdir -p "$out"
rm -f "$out"/recsys-*.whl
# maturin's PEP 517 backend takes its cargo features from this variable.
MATURIN_PEP517_ARGS=${features:+--features $features} \
  "$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$out" ./python >&2
if ! wheel=$(compgen -G "$out/recsys-*-cp39-abi3-*.whl"); then
  echo "error: the recsys wheel is not an abi3 wheel for CPython 3.9+: $(ls "$out")" >&2
  exit 1
fi
echo "$wheel"
