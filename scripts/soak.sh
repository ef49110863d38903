#!/usr/bin/env bash
# Soak and fault test against the real tritonserver (bounded; see scripts/soak.py).
#   scripts/soak.sh [--seconds 600] [--concurrency 4] [--out out/soak]
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/python-env.sh
cargo build --release --locked -p recsys-cli -p recsys-backend
mkdir -p build/backends/recsys
cp target/release/libtriton_recsys.so build/backends/recsys/
for m in bert4rec vaecf; do
  [[ -f model_repository/$m/config.pbtxt ]] || { echo "model_repository/$m/config.pbtxt is missing" >&2; exit 1; }
done
exec .venv/bin/python scripts/soak.py "$@"
