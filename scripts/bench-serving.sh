#!/usr/bin/env bash
# Serving benchmarks with the real perf_analyzer (bounded):
#   scripts/bench-serving.sh [ARGS]          recsys alone (scripts/bench_serving.py)
#   scripts/bench-serving.sh --peers [ARGS]  recsys against the Python backend + onnxruntime peer and
#                                            the dynamic-batching study (scripts/bench_peers.py)
# perf_analyzer's runtime needs (libb64, libcudart) are installed by scripts/python-env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bench=scripts/bench_serving.py
if [[ ${1:-} == --peers ]]; then
  bench=scripts/bench_peers.py
  shift
fi
./scripts/python-env.sh
cargo build --release --locked -p recsys-converter -p recsys-backend
mkdir -p build/backends/recsys
cp target/release/libtriton_recsys.so build/backends/recsys/
for m in bert4rec vaecf; do
  [[ -f model_repository/$m/1/manifest.json ]] || { echo "model_repository/$m/1 has no engine: run scripts/serve.sh --check once" >&2; exit 1; }
done
exec .venv/bin/python "$bench" "$@"
