#!/usr/bin/env bash
# recsys against the Python backend + onnxruntime peer, and the dynamic-batching study, with the real
# perf_analyzer (bounded; see scripts/bench_peers.py).
# perf_analyzer from the tritonclient wheel needs libb64.so.0d (Debian libb64-0d) and
# libcudart.so.12 (PyPI nvidia-cuda-runtime-cu12) even without a GPU; both are installed here.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/python-env.sh
.venv/bin/pip install --quiet "nvidia-cuda-runtime-cu12==12.*"
if ! ldconfig -p | grep -q libb64.so.0d; then
  if [[ $(id -u) -eq 0 ]]; then
    apt-get update -qq && apt-get install -y -qq libb64-0d
  else
    echo "perf_analyzer needs libb64.so.0d: sudo apt-get install libb64-0d" >&2
    exit 1
  fi
fi
cargo build --release --locked -p recsys-converter -p recsys-backend
mkdir -p build/backends/recsys
cp target/release/libtriton_recsys.so build/backends/recsys/
for m in bert4rec vaecf; do
  [[ -f model_repository/$m/1/manifest.json ]] || { echo "model_repository/$m/1 has no engine: run scripts/serve.sh --check once" >&2; exit 1; }
done
exec .venv/bin/python scripts/bench_peers.py "$@"
