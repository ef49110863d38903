#!/usr/bin/env bash
# Every benchmark, one entry point. Each kind builds what it measures in release mode, uses the
# Python environment of scripts/python-env.sh (the real tritonserver, perf_analyzer, onnxruntime),
# runs bounded in time and requests, and prints the table for docs/BENCHMARKS.md:
#
#   scripts/bench.sh kernels [ARGS]   fused score + top-k against ONNX Runtime, numpy and the measured
#                                     memory/FMA floor on the same weights (scripts/bench_kernels.py)
#   scripts/bench.sh models [ARGS]    whole models against ONNX Runtime and OpenVINO (f32 and its
#                                     default precision) (scripts/bench_models.py)
#   scripts/bench.sh sequential [ARGS] SASRec and GRU4Rec against ONNX Runtime and OpenVINO on their
#                                     PyTorch-style exports (scripts/bench_sequential.py)
#   scripts/bench.sh sessions [ARGS]  growing sessions, per event: GRU4Rec, SASRec and HSTU with their prefix caches and
#                                     without, and ONNX Runtime and OpenVINO recomputing (scripts/bench_sessions.py)
#   scripts/bench.sh hstu [ARGS]      HSTU at ML-1M's and ML-20M's shapes against the official research
#                                     module (--official-repo), ONNX Runtime and OpenVINO (scripts/bench_hstu.py)
#   scripts/bench.sh python-sessions [ARGS] growing sessions through the Python package, with the
#                                     prefix cache and without (scripts/bench_python_sessions.py)
#   scripts/bench.sh serving-sessions [ARGS] growing sessions through tritonserver under perf_analyzer:
#                                     GRU4Rec, SASRec and HSTU with and without the prefix cache, hit rate and
#                                     p50/p99 (scripts/bench_serving_sessions.py)
#   scripts/bench.sh threads [ARGS]   the thread plan against all threads and one thread, per batch
#                                     size, on the four fixture models (scripts/bench_threads.py)
#   scripts/bench.sh bf16 [ARGS]      bf16 engines on AVX512-BF16: the per-batch kernel plan against
#                                     vdpbf16ps and widened pinned, and against fp32 (scripts/bench_bf16.py)
#   scripts/bench.sh amx [ARGS]       bf16 engines on an AMX Xeon: layers on AMX tiles against the SIMD
#                                     kernels, the measured AMX plan, and fp32 (scripts/bench_amx.py)
#   scripts/bench.sh predict [ARGS]   offline batch scoring against a Python + ONNX Runtime loop
#                                     and OpenVINO (scripts/bench_predict.py)
#   scripts/bench.sh serving [ARGS]   recsys in tritonserver under perf_analyzer (scripts/bench_serving.py)
#   scripts/bench.sh peers [ARGS]     recsys against the Python backend + onnxruntime peer in the same
#                                     server, and the dynamic-batching study (scripts/bench_peers.py)
#   scripts/bench.sh candidates [ARGS] candidate re-ranking against whole-catalogue top-k at 1e6 items,
#                                     in the engine, through the backend and in ONNX Runtime
#                                     (scripts/bench_candidates.py)
#   scripts/bench.sh ray [ARGS]       recsys.ray.predict (1 and 2 actors) against recsys predict
#                                     --threads 1/2 on the same users (scripts/bench_ray.py)
#   scripts/bench.sh catalogue [ARGS] the catalogue scan against recsys's own embedding + FAISS
#                                     IndexFlatIP over export-items (scripts/bench_faiss.py), then
#                                     whole models at 1e6 items in tritonserver, recsys (screened and
#                                     not) against the Python backend + onnxruntime peer, concurrency
#                                     1 and 8, with and without dynamic batching (scripts/bench_catalogue.py)
#   scripts/bench.sh live-catalogue [ARGS] an engine with a catalogue delta (items added, items
#                                     retired) against the catalogue compiled in, at 1e6 items, and
#                                     what putting the delta in force costs (scripts/bench_live_catalogue.py)
#   scripts/bench.sh fold-in [ARGS]   rows for items cut out of the trained fixtures, folded back in
#                                     from their training interactions, against the trained rows
#                                     (HR@k of their held-out interactions; scripts/bench_fold_in.py)
#   scripts/bench.sh load [ARGS]      load time, owned and resident memory of engines whose kernels'
#                                     layout is mapped from kernels.bin against packed at load
#                                     (scripts/bench_load.py)
#
# ARGS go to the Python script (`--help` lists them).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,47p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[[ $# -ge 1 ]] || usage
kind=$1
shift

release_build() { cargo build --release --locked "$@"; }

# The serving build of the backend in build/backends, and the recsys command.
backend_setup() {
  release_build -p recsys-cli -p recsys-backend
  mkdir -p build/backends/recsys
  cp target/release/libtriton_recsys.so build/backends/recsys/
}

# ... and the demo engines that the serving benchmarks load.
serving_setup() {
  backend_setup
  local m
  for m in bert4rec vaecf; do
    [[ -f model_repository/$m/1/manifest.json ]] || {
      echo "model_repository/$m/1 has no engine: run scripts/serve.sh --check once" >&2
      exit 1
    }
  done
}

python=.venv/bin/python

# The Python-backend peers run inside tritonserver on the test venv's interpreter (numpy < 2);
# their runtimes at the latest releases go to a folder of their own that the peer puts first on
# its path (RECSYS_PEER_SITE), so the test venv's pinned onnxruntime is left as it is.
serving_peers_setup() {
  local site=.venv/serving-peers
  if [[ ! -f $site/.recsys-serving-peers-v1 ]]; then
    "$python" -m pip install --quiet --no-deps --target "$site" \
      "onnxruntime==1.31.1" "openvino==2026.4.1" "openvino-telemetry==2025.2.0" "flatbuffers==25.12.19"
    touch "$site/.recsys-serving-peers-v1"
  fi
  export RECSYS_PEER_SITE=$PWD/$site
}
# The peer runtimes at their latest releases (scripts/python-env.sh --peers).
peers_python=.venv/peers/bin/python
case "$kind" in
  kernels)
    ./scripts/python-env.sh
    release_build -p recsys-benches --bin kernel_probe
    # numpy runs with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset (they force an older, slower
    # OpenBLAS kernel on some machines); the table names the BLAS kernel that actually ran.
    exec env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$python" scripts/bench_kernels.py "$@"
    ;;
  models)
    ./scripts/python-env.sh --peers
    release_build -p recsys-cli -p recsys-benches --bin recsys --bin model_probe --bin kernel_probe
    exec "$peers_python" scripts/bench_models.py "$@"
    ;;
  sequential)
    ./scripts/python-env.sh --peers
    release_build -p recsys-cli -p recsys-benches --bin recsys --bin model_probe --bin kernel_probe
    exec "$peers_python" scripts/bench_sequential.py "$@"
    ;;
  sessions)
    ./scripts/python-env.sh --peers
    release_build -p recsys-cli -p recsys-benches --bin recsys --bin session_probe
    exec "$peers_python" scripts/bench_sessions.py "$@"
    ;;
  hstu)
    ./scripts/python-env.sh --hstu-peers
    release_build -p recsys-cli -p recsys-benches --bin recsys --bin model_probe
    exec .venv/hstu-peers/bin/python scripts/bench_hstu.py "$@"
    ;;
  python-sessions)
    ./scripts/python-env.sh
    release_build -p recsys-cli
    .venv/bin/pip install --quiet --force-reinstall --no-deps ./python
    exec "$python" scripts/bench_python_sessions.py "$@"
    ;;
  serving-sessions)
    ./scripts/python-env.sh
    backend_setup
    exec "$python" scripts/bench_serving_sessions.py "$@"
    ;;
  threads)
    release_build -p recsys-cli -p recsys-benches --bin recsys --bin model_probe
    exec python3 scripts/bench_threads.py "$@"
    ;;
  bf16)
    release_build -p recsys-cli -p recsys-benches --bin recsys --bin model_probe
    exec python3 scripts/bench_bf16.py "$@"
    ;;
  amx)
    ./scripts/python-env.sh --peers
    release_build -p recsys-cli -p recsys-benches --bin recsys --bin model_probe
    exec "$peers_python" scripts/bench_amx.py "$@"
    ;;
  predict)
    ./scripts/python-env.sh --peers
    release_build -p recsys-cli
    exec "$peers_python" scripts/bench_predict.py "$@"
    ;;
  serving | peers)
    # perf_analyzer's runtime needs (libb64, libcudart) are installed by scripts/python-env.sh.
    ./scripts/python-env.sh
    serving_setup
    if [[ $kind == serving ]]; then
      exec "$python" scripts/bench_serving.py "$@"
    fi
    serving_peers_setup
    exec "$python" scripts/bench_peers.py "$@"
    ;;
  candidates)
    ./scripts/python-env.sh
    backend_setup
    release_build -p recsys-benches --bin model_probe
    exec "$python" scripts/bench_candidates.py "$@"
    ;;
  catalogue)
    ./scripts/python-env.sh
    ./scripts/python-env.sh --peers
    backend_setup
    release_build -p recsys-benches --bin model_probe
    serving_peers_setup
    # The catalogue scan against FAISS over export-items first (in process), then the servers.
    "$peers_python" scripts/bench_faiss.py "$@"
    exec "$python" scripts/bench_catalogue.py "$@"
    ;;
  live-catalogue)
    ./scripts/python-env.sh
    release_build -p recsys-cli -p recsys-benches --bin recsys --bin model_probe
    exec "$python" scripts/bench_live_catalogue.py "$@"
    ;;
  fold-in)
    ./scripts/python-env.sh
    release_build -p recsys-cli --bin recsys
    exec "$python" scripts/bench_fold_in.py "$@"
    ;;
  load)
    ./scripts/python-env.sh
    cargo build --release --locked -p recsys-cli
    .venv/bin/pip install --quiet --force-reinstall --no-deps ./python
    exec "$python" scripts/bench_load.py "$@"
    ;;
  ray)
    ./scripts/python-env.sh
    release_build -p recsys-cli
    .venv/bin/pip install --quiet --force-reinstall --no-deps ./python
    exec "$python" scripts/bench_ray.py "$@"
    ;;
  -h | --help) usage ;;
  *)
    echo "error: unknown benchmark '$kind' (kernels, models, sequential, hstu, sessions, python-sessions, serving-sessions, predict, serving, peers, candidates, ray, catalogue, live-catalogue, fold-in, load)" >&2
    exit 2
    ;;
esac
