#!/usr/bin/env bash
# Builds the GPU check as a self-contained bundle, on an ordinary machine, for a GPU machine that has
# the NVIDIA driver, a CUDA toolkit and python3 (with torch for the peer timing) but no Rust
# toolchain and no network:
#
#   scripts/gpu-bundle.sh DIR [--cuda 12|13] [--standalone]   (default 13: the H200 machine's toolkit)
#   DIR/run.sh RESULTS_DIR                 on the GPU machine: device tests, timings, summary.md
#   DIR/run.sh --dry-run RESULTS_DIR       anywhere: every binary starts and links, fixtures found
#   DIR/run.sh --unpack OUT                unpacks the programs into OUT, to run one by hand
#
# DIR receives run.sh (gpu/bundle/launch.sh), BUILD and payload.tar.xz: the release test binaries
# and examples built with the CUDA bindings for that major version (kernel sources are embedded in
# them and compiled by NVRTC at load), the backend (libtriton_recsys.so) and the recsys Python
# package built with the same bindings, the
# Python peer, check and summary scripts, and the inner run.sh (gpu/bundle/run.sh). The trained
# fixtures are read from the checkout the bundle sits in (DIR inside it, e.g. build/gpu-bundle),
# since a device call carries the checkout anyway; --standalone packs them in too, for a bundle
# copied elsewhere. Budget: a device call carries at most 64 MiB, the tracked checkout included,
# so the checkout plus DIR must stay under 60 MiB (checked here).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: scripts/gpu-bundle.sh DIR [--cuda 12|13] [--standalone]" >&2; exit 2; }
dir=""
cuda=13
standalone=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cuda) [[ $# -ge 2 ]] || usage; cuda=$2; shift 2 ;;
    --standalone) standalone=1; shift ;;
    -h|--help) usage ;;
    -*) echo "error: unknown option $1" >&2; usage ;;
    *) [[ -z "$dir" ]] || usage; dir=$1; shift ;;
  esac
done
[[ -n "$dir" ]] || usage
[[ "$cuda" == 12 || "$cuda" == 13 ]] || { echo "error: --cuda takes 12 or 13, not $cuda" >&2; exit 2; }
limit_mib=60
command -v xz >/dev/null || { echo "error: xz is needed to pack the bundle" >&2; exit 1; }

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
stage=$(mktemp -d)
trap 'rm -rf "$build_log" "$stage"' EXIT
{
  executables test --release --locked --no-run -p recsys-gpu --features "cuda-$cuda" \
    --lib --test gpu_kernels --test gpu_model --test nvrtc_compile
  executables build --release --locked -p recsys-gpu --features "cuda-$cuda" \
    --example gpu_bench --example gpu_model_bench
  executables test --release --locked --no-run -p recsys-backend --features "recsys-backend/cuda-$cuda" --lib
} >"$build_log"

# Everything is staged in $stage, then packed into $dir/payload.tar.xz.
mkdir -p "$stage/bin"
# Bundle names: gpu_lib, gpu_kernels, gpu_model, nvrtc_compile, backend_lib, gpu_bench, gpu_model_bench.
while read -r name path; do
  case "$name" in
    recsys_gpu_lib) target=gpu_lib ;;
    triton_recsys_lib) target=backend_lib ;;
    *) target=$name ;;
  esac
  cp "$path" "$stage/bin/$target"
  strip --strip-debug "$stage/bin/$target"
done <"$build_log"
for needed in gpu_lib gpu_kernels gpu_model nvrtc_compile backend_lib gpu_bench gpu_model_bench; do
  [[ -x "$stage/bin/$needed" ]] || { echo "error: the build produced no $needed" >&2; exit 1; }
done

# The backend itself, as tritonserver loads it, for the serving half of the check
# (scripts/gpu-serving-bundle.sh), which takes it from here: it shares most of its code with
# backend_lib, so it costs the packed payload little, where the serving half's call has no room.
cargo build --release --locked -p recsys-backend --features "recsys-backend/cuda-$cuda" >&2
mkdir -p "$stage/backends/recsys"
cp target/release/libtriton_recsys.so "$stage/backends/recsys/"
strip --strip-unneeded "$stage/backends/recsys/libtriton_recsys.so"

# The Python package with the GPU path, unpacked (run.sh puts it on PYTHONPATH): stripped, since
# the wheel's debug information alone would not fit the budget.
wheels=$(mktemp -d)
MATURIN_PEP517_ARGS="--features cuda-$cuda --strip" python3 -m pip wheel --quiet --no-deps \
  --wheel-dir "$wheels" ./python >&2
mkdir -p "$stage/python"
python3 -m zipfile -e "$wheels"/recsys-*.whl "$stage/python"
rm -rf "$wheels"
cp gpu/bundle/python_device_check.py "$stage/"

if ((standalone)); then
  mkdir -p "$stage/fixtures"
  cp tests/fixtures/test_set.tsv "$stage/fixtures/"
  for model in bert4rec multivae sasrec gru4rec hstu; do
    mkdir -p "$stage/fixtures/$model"
    cp tests/fixtures/$model/{config.json,item_id_map.tsv,model.safetensors} "$stage/fixtures/$model/"
  done
  # HSTU's test users come with their event times.
  cp tests/fixtures/hstu/test_set.tsv.gz "$stage/fixtures/hstu/"
fi
cp gpu/bundle/run.sh "$stage/run.sh"
cp gpu/bundle/nvrtc.sh "$stage/"
cp gpu/bundle/summary.py scripts/gpu_bench_torch.py "$stage/"
chmod +x "$stage/run.sh"

rm -rf "$dir"
mkdir -p "$dir"
# xz with the x86 branch filter and a dictionary that spans the whole payload: the binaries share
# most of their code (the engine, the GPU path), which gzip's 32 KiB window cannot see; 6 MiB
# against gzip's 16.
tar -C "$stage" -cf - . | xz --x86 --lzma2=preset=9e,dict=64MiB -T0 >"$dir/payload.tar.xz"
cp gpu/bundle/launch.sh "$dir/run.sh"
chmod +x "$dir/run.sh"
{
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
  echo "cuda bindings: $cuda"
  echo "rustc: $(rustc --version)"
} >"$dir/BUILD"

bundle_bytes=$(du -sb "$dir" | cut -f1)
# What a device call carries besides the bundle: the tracked files of this checkout (a standalone
# bundle travels alone).
tree_bytes=0
if ((!standalone)); then
  tree_bytes=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
fi
mib() { echo $((($1 + 1048575) / 1048576)); }
binaries=$(xz -dc "$dir/payload.tar.xz" | tar -tf - | grep -c '^\./bin/.')
if ((standalone)); then
  echo "==> $dir: $(mib "$bundle_bytes") MiB ($binaries binaries, fixtures; travels alone) of the $limit_mib MiB budget"
else
  echo "==> $dir: $(mib "$bundle_bytes") MiB ($binaries binaries); with the checkout's tracked files: $(mib $((bundle_bytes + tree_bytes))) MiB of the $limit_mib MiB budget"
fi
if ((bundle_bytes + tree_bytes > limit_mib * 1048576)); then
  echo "error: the bundle ($(mib "$bundle_bytes") MiB) and the checkout's tracked files ($(mib "$tree_bytes") MiB) are over the $limit_mib MiB a device call may carry with room to spare" >&2
  exit 1
fi
