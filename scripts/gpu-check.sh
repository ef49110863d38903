#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU, its driver, the CUDA toolkit (NVRTC, ptxas) and
# PyTorch. One call, a few minutes:
#   1. builds recsys-gpu with the `cuda` feature;
#   2. runs its device tests (every kernel against an f64 reference on
#      fresh random inputs: fp32/fp16/int8 weights, N at/around the tile size and 100,003, k = 1, 10,
#      100, 1024, batch 1/7/64, random exclusions; both trained fixtures as whole models on the GPU
#      against the CPU engine at fp32/fp16/int8/W8A8) and the NVRTC + ptxas
#      spill check;
#   3. times whole models on the GPU against the CPU engine (fixtures, batch 1 and 64, top-10), and
#      the fused kernel against torch.matmul + torch.topk on the same data (N = 1e6, d = 64,
#      k = 100, batch 1 and 64, fp32 and fp16) and prints achieved bandwidth against measured copy
#      bandwidth. Copy the printed table into docs/BENCHMARKS.md with the date and GPU.
#   scripts/gpu-check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)}
mkdir -p "$out"
cuda_home=${CUDA_HOME:-/usr/local/cuda}
export LD_LIBRARY_PATH="$cuda_home/lib64:${LD_LIBRARY_PATH:-}"
export RECSYS_PTXAS=${RECSYS_PTXAS:-$(command -v ptxas || echo "$cuda_home/bin/ptxas")}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv | tee "$out/gpu.csv"
echo "==> build (release, --features cuda)"
cargo build --release -p recsys-gpu --features cuda --examples --tests
echo "==> CUDA test suite (device tests included)"
cargo test --release -p recsys-gpu --features cuda --lib --test gpu_kernels --test gpu_model --test nvrtc_compile \
  -- --include-ignored --nocapture 2>&1 | tee "$out/tests.log"
echo "==> fused kernel timing"
cargo run --release -q -p recsys-gpu --features cuda --example gpu_bench -- "$out" | tee "$out/fused.json"
echo "==> whole models: GPU (encoder + fused top-k) against the CPU engine, same process"
cargo run --release -q -p recsys-gpu --features cuda --example gpu_model_bench | tee "$out/models.json"
echo "==> torch.matmul + torch.topk on the same data"
python3 scripts/gpu_bench_torch.py "$out" | tee "$out/table.md"
