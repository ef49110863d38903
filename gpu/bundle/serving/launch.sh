#!/usr/bin/env bash
# The serving half of the GPU check, from a bundle made by scripts/gpu-serving-bundle.sh (installed
# as DIR/serve/run.sh): tritonserver with the recsys backend serving KIND_GPU and KIND_CPU models of
# the four families side by side (serving_check.py). Needs python3 with numpy and what the first
# device call left on the machine: the kernel bundle (build/gpu-bundle: the backend, the Python
# package that converts the fixtures, gpu_bench that names each NVRTC's version) and
# DIR/with-kernels (the server's ICU data). No Rust toolchain, no network.
#
#   run.sh RESULTS_DIR              on the GPU machine; about 2-3 minutes
#   run.sh --cpu-only RESULTS_DIR   on any machine: the KIND_CPU half, to check the bundle itself
#
# RESULTS_DIR receives summary.md, serving.json, server.log and env.log.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)

usage() { echo "usage: run.sh [--cpu-only] RESULTS_DIR" >&2; exit 2; }
cpu_only=()
if [[ "${1:-}" == "--cpu-only" ]]; then cpu_only=(--cpu-only); shift; fi
[[ $# -eq 1 ]] || usage
mkdir -p "$1" || exit 1
results=$(cd "$1" && pwd)
checkout=${RECSYS_CHECKOUT:-$(cd "$here/../../.." && pwd)}
kernels=${RECSYS_GPU_BUNDLE:-$checkout/build/gpu-bundle}
icu=${RECSYS_SERVING_ICU:-$here/../with-kernels/icu.tar.xz}
fixtures=${RECSYS_FIXTURES:-$checkout/tests/fixtures}
: >"$results/env.log"
note() { echo "$*" | tee -a "$results/env.log"; }
fail() { note "error: $*"; exit 1; }

[[ -f "$kernels/payload.tar.xz" && -f "$kernels/BUILD" ]] \
  || fail "no kernel bundle at $kernels: run its call first on the same machine (build/gpu-bundle/run.sh, carrying build/gpu-bundle and $(dirname "$icu")), or set RECSYS_GPU_BUNDLE"
[[ -f "$icu" ]] || fail "no $icu: the kernel bundle's call carries it (carry $(dirname "$icu") with build/gpu-bundle), or set RECSYS_SERVING_ICU"
[[ -f "$fixtures/test_set.tsv" ]] || fail "no trained fixtures at $fixtures (set RECSYS_FIXTURES)"
cuda_major=$(sed -n 's/^cuda bindings: //p' "$kernels/BUILD")
note "serving bundle: $(tr '\n' ';' <"$here/BUILD")"
note "kernel bundle: $(tr '\n' ';' <"$kernels/BUILD")"

work=$(mktemp -d "${TMPDIR:-/tmp}/recsys-gpu-serving.XXXXXX") || exit 1
trap 'rm -rf "$work" "${nvrtc_pin_dir:-}"' EXIT
# xz archives through Python's lzma (which decodes the x86 filter), so the machine needs no xz.
untar() { # untar ARCHIVE DIR [MEMBER...]: the whole archive, or the named files and folders
  python3 - "$@" <<'PY'
import sys, tarfile
archive_path, into, wanted = sys.argv[1], sys.argv[2], sys.argv[3:]
with tarfile.open(archive_path, "r:*") as archive:
    members = [m for m in archive.getmembers()
               if not wanted or any(m.name == w or m.name.startswith(w + "/") for w in wanted)]
    if wanted and not members:
        sys.exit(f"{archive_path} holds none of {wanted}")
    if hasattr(tarfile, "data_filter"):
        archive.extractall(into, members=members, filter="data")
    else:
        archive.extractall(into, members=members)
PY
}
untar "$here/payload.tar.xz" "$work" || fail "cannot unpack $here/payload.tar.xz"
untar "$icu" "$work/tritonserver" || fail "cannot unpack $icu"
untar "$kernels/payload.tar.xz" "$work/kernels" ./backends ./python ./bin/gpu_bench ./nvrtc.sh \
  || fail "cannot take the backend, the Python package, gpu_bench and nvrtc.sh from $kernels/payload.tar.xz"

device="no GPU (KIND_CPU only)"
if [[ ${#cpu_only[@]} -eq 0 ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    device=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n1)
    note "GPU: $device"
  else
    fail "no GPU driver answers (nvidia-smi): run with --cpu-only to check the bundle without one"
  fi
  # shellcheck source=../nvrtc.sh
  source "$work/kernels/nvrtc.sh"
  choose_nvrtc "$cuda_major" "$work/kernels/bin/gpu_bench" --versions
fi
PYTHONPATH="$work/kernels/python${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=10 480 \
  python3 "$work/serving_check.py" --server "$work/tritonserver/bin/tritonserver" \
  --server-libraries "$work/tritonserver/lib" --backends "$work/kernels/backends" --fixtures "$fixtures" \
  --results "$results" --cuda "$cuda_major" --device "$device" "${cpu_only[@]}"
status=$?
echo "serving check: exit $status; results in $results"
exit $status
