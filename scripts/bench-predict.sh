#!/usr/bin/env bash
# Offline batch scoring against a Python + ONNX Runtime loop (see scripts/bench_predict.py).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/python-env.sh
cargo build --release --locked -p recsys-converter
exec .venv/bin/python scripts/bench_predict.py "$@"
