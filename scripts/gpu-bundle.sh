#!/usr/bin/env bash
# Builds the GPU check as a self-contained bundle, on an ordinary machine, for a GPU machine that has
# the NVIDIA driver, a CUDA toolkit and python3 (with torch for the peer timing) but no Rust
# toolchain and no network:
#
#   scripts/gpu-bundle.sh DIR [--cuda 12|13]     (default 13: the toolkit and driver of the H200 machine)
#   DIR/run.sh RESULTS_DIR                         on the GPU machine: device tests, timings, summary.md
#   DIR/run.sh --dry-run RESULTS_DIR               anywhere: every binary starts and links, fixtures found
#
# DIR receives the release test binaries and examples built with the CUDA bindings for that major
# version (kernel sources are embedded in them and compiled by NVRTC at load), the recsys Python
# package built with the same bindings, the trained fixtures they read, the Python peer, check and
# summary scripts, and run.sh (gpu/bundle/run.sh). The bundle must stay under 56 MiB: a device
# call carries 64 MiB, and the bundle is kept under 60 with room for what a change adds (the
# backend's test binary links the object-store client of the live availability poller).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: scripts/gpu-bundle.sh DIR [--cuda 12|13]" >&2; exit 2; }
dir=""
cuda=13
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cuda) [[ $# -ge 2 ]] || usage; cuda=$2; shift 2 ;;
    -h|--help) usage ;;
    -*) echo "error: unknown option $1" >&2; usage ;;
    *) [[ -z "$dir" ]] || usage; dir=$1; shift ;;
  esac
done
[[ -n "$dir" ]] || usage
[[ "$cuda" == 12 || "$cuda" == 13 ]] || { echo "error: --cuda takes 12 or 13, not $cuda" >&2; exit 2; }
limit_mib=56

# Executables of one cargo invocation, from its JSON messages: "name path" lines.
executables() {
  cargo "$@" --message-format=json-render-diagnostics \
    | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        kinds = m["target"]["kind"]
        name = m["target"]["name"]
        if "lib" in kinds or "cdylib" in kinds or "rlib" in kinds:
            name = m["target"]["name"] + "_lib"
        print(name, m["executable"])
'
}

echo "==> building the GPU check for CUDA $cuda (release)"
build_log=$(mktemp)
trap 'rm -f "$build_log"' EXIT
{
  executables test --release --locked --no-run -p recsys-gpu --features "cuda-$cuda" \
    --lib --test gpu_kernels --test gpu_model --test nvrtc_compile
  executables build --release --locked -p recsys-gpu --features "cuda-$cuda" \
    --example gpu_bench --example gpu_model_bench
  executables test --release --locked --no-run -p recsys-backend --features "recsys-backend/cuda-$cuda" --lib
} >"$build_log"

rm -rf "$dir"
mkdir -p "$dir/bin" "$dir/fixtures/bert4rec" "$dir/fixtures/multivae" "$dir/fixtures/sasrec" "$dir/fixtures/gru4rec"
# Bundle names: gpu_lib, gpu_kernels, gpu_model, nvrtc_compile, backend_lib, gpu_bench, gpu_model_bench.
while read -r name path; do
  case "$name" in
    recsys_gpu_lib) target=gpu_lib ;;
    triton_recsys_lib) target=backend_lib ;;
    *) target=$name ;;
  esac
  cp "$path" "$dir/bin/$target"
  strip --strip-debug "$dir/bin/$target"
done <"$build_log"
for needed in gpu_lib gpu_kernels gpu_model nvrtc_compile backend_lib gpu_bench gpu_model_bench; do
  [[ -x "$dir/bin/$needed" ]] || { echo "error: the build produced no $needed" >&2; exit 1; }
done

# The Python package with the GPU path, unpacked (run.sh puts it on PYTHONPATH): stripped, since
# the wheel's debug information alone would not fit the budget.
wheels=$(mktemp -d)
MATURIN_PEP517_ARGS="--features cuda-$cuda --strip" python3 -m pip wheel --quiet --no-deps \
  --wheel-dir "$wheels" ./python >&2
mkdir -p "$dir/python"
python3 -m zipfile -e "$wheels"/recsys-*.whl "$dir/python"
rm -rf "$wheels"
cp gpu/bundle/python_device_check.py "$dir/"

cp tests/fixtures/test_set.tsv "$dir/fixtures/"
for model in bert4rec multivae sasrec gru4rec; do
  cp tests/fixtures/$model/{config.json,item_id_map.tsv,model.safetensors} "$dir/fixtures/$model/"
done
cp gpu/bundle/run.sh "$dir/run.sh"
cp gpu/bundle/summary.py scripts/gpu_bench_torch.py "$dir/"
chmod +x "$dir/run.sh"
{
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
  echo "cuda bindings: $cuda"
  echo "rustc: $(rustc --version)"
} >"$dir/BUILD"

size_kib=$(du -sk "$dir" | cut -f1)
echo "==> $dir: $((size_kib / 1024)) MiB ($(ls "$dir/bin" | wc -l) binaries)"
if ((size_kib > limit_mib * 1024)); then
  echo "error: the bundle is $((size_kib / 1024)) MiB, over its $limit_mib MiB budget" >&2
  exit 1
fi
