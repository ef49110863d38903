#!/usr/bin/env bash
# The GPU check on a machine that has both a Rust toolchain and an NVIDIA GPU: builds the bundle
# (scripts/gpu-bundle.sh) for the CUDA major version of the toolkit found here and runs it. A GPU
# machine without Rust takes the bundle built elsewhere: scripts/gpu-bundle.sh DIR there, DIR/run.sh here.
#   scripts/gpu-check.sh [RESULTS_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
results=${1:-$(mktemp -d)}
cuda=${RECSYS_CUDA_MAJOR:-$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9]*\)\..*/\1/p')}
./scripts/gpu-bundle.sh build/gpu-bundle --cuda "${cuda:-13}"
exec build/gpu-bundle/run.sh "$results"
