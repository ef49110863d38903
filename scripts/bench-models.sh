#!/usr/bin/env bash
# Whole models against ONNX Runtime (see scripts/bench_models.py).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/python-env.sh
cargo build --release --locked -p recsys-converter -p recsys-benches --bin model_probe
exec .venv/bin/python scripts/bench_models.py "$@"
