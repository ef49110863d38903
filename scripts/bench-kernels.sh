#!/usr/bin/env bash
# Kernel comparison (see scripts/bench_kernels.py). numpy is run with OPENBLAS_CORETYPE and
# OPENBLAS_L2_SIZE unset (they force an older, slower OpenBLAS kernel on some machines); the table
# names the BLAS kernel that actually ran.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/python-env.sh
cargo build --release --locked -p recsys-benches --bin kernel_probe
exec env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python scripts/bench_kernels.py "$@"
