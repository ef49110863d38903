#!/usr/bin/env bash
# Builds the serving half of the GPU check: a real tritonserver with the recsys backend serving
# KIND_GPU and KIND_CPU instances of the four model families side by side, compared request by
# request and under a bounded load. The GPU machine has no network and no tritonserver, so the
# server travels built, from the venv's nvidia-pytriton (tritonserver 2.51, release 24.10) with
# the libraries it loads, stripped of their symbol tables.
#
#   scripts/gpu-serving-bundle.sh DIR
#
# A device call carries the checkout too (64 MiB in all), and the server with its libraries does
# not fit beside the kernel bundle (scripts/gpu-bundle.sh), so the check runs in two calls on one
# warm machine, and this script writes the parts each call carries:
#
#   DIR/with-kernels/  tritonserver's ICU data (libxml2's character sets, 7 MiB packed): carried
#                      by the kernel bundle's call (carry build/gpu-bundle and DIR/with-kernels),
#                      whose run leaves it on the machine
#   DIR/serve/         run.sh, BUILD and payload.tar.xz (tritonserver, its other libraries, the
#                      check's script): carried by the next call
#
#   DIR/serve/run.sh RESULTS_DIR              on the GPU machine, after build/gpu-bundle/run.sh
#   DIR/serve/run.sh --cpu-only RESULTS_DIR   on any machine: the same check, KIND_CPU models only
#
# The backend (built for the kernel bundle's CUDA version) and the Python package that converts the
# fixtures there are the kernel bundle's (build/gpu-bundle, left by the first call). Each call
# must stay under 60 MiB with the checkout's tracked files (checked here, for both calls).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: scripts/gpu-serving-bundle.sh DIR" >&2; exit 2; }
dir=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage ;;
    -*) echo "error: unknown option $1" >&2; usage ;;
    *) [[ -z "$dir" ]] || usage; dir=$1; shift ;;
  esac
done
[[ -n "$dir" ]] || usage
limit_mib=60
VENV=${RECSYS_VENV:-.venv}
[[ -x "$VENV/bin/python" ]] || { echo "error: no $VENV: run scripts/python-env.sh --serve first" >&2; exit 1; }
site=$("$VENV/bin/python" -c 'import pytriton, pathlib; print(pathlib.Path(pytriton.__file__).parent.parent)')
server="$site/pytriton/tritonserver/bin/tritonserver"
libs="$site/nvidia_pytriton.libs"
[[ -x "$server" && -d "$libs" ]] || { echo "error: $VENV has no nvidia-pytriton tritonserver" >&2; exit 1; }
command -v xz >/dev/null || { echo "error: xz is needed to pack the bundle" >&2; exit 1; }

stage=$(mktemp -d)
icu_stage=$(mktemp -d)
trap 'rm -rf "$stage" "$icu_stage"' EXIT
mkdir -p "$stage/tritonserver/bin" "$stage/tritonserver/lib" "$icu_stage/lib"
cp "$server" "$stage/tritonserver/bin/"
# The libraries the server loads, found by the loader from the server itself (nvidia-pytriton
# renames each with a hash; the server's RUNPATH points at their folder, run.sh's library path
# replaces it). The ICU data goes to the first call's part.
LD_LIBRARY_PATH="$libs" ldd "$server" | awk '$3 ~ /nvidia_pytriton.libs/ { print $3 }' | while read -r lib; do
  case "$(basename "$lib")" in
    libicudata*) cp "$lib" "$icu_stage/lib/" ;;
    *) cp "$lib" "$stage/tritonserver/lib/" ;;
  esac
done
[[ -n "$(ls "$icu_stage/lib")" ]] || { echo "error: tritonserver no longer loads an ICU data library; revise this script" >&2; exit 1; }
# Symbol tables are not needed to run; debug information is most of their size.
strip --strip-unneeded "$stage/tritonserver/bin/tritonserver" "$stage"/tritonserver/lib/* \
  "$icu_stage"/lib/*
cp gpu/bundle/serving/serving_check.py "$stage/"

# xz with the x86 branch filter: executables pack about a tenth smaller than with xz alone.
pack() { tar -C "$1" -cf - . | xz --x86 --lzma2=preset=9e,dict=64MiB -T0 >"$2"; }
rm -rf "$dir"
mkdir -p "$dir/serve" "$dir/with-kernels"
pack "$stage" "$dir/serve/payload.tar.xz"
pack "$icu_stage" "$dir/with-kernels/icu.tar.xz"
cp gpu/bundle/serving/launch.sh "$dir/serve/run.sh"
chmod +x "$dir/serve/run.sh"
{
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
  echo "tritonserver: nvidia-pytriton $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("nvidia-pytriton"))')"
} >"$dir/serve/BUILD"

# The two calls' budgets, each with the checkout's tracked files.
mib() { echo $((($1 + 1048575) / 1048576)); }
tree_bytes=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
serve_bytes=$(du -sb "$dir/serve" | cut -f1)
icu_bytes=$(du -sb "$dir/with-kernels" | cut -f1)
kernels_bytes=0
[[ -d build/gpu-bundle ]] && kernels_bytes=$(du -sb build/gpu-bundle | cut -f1)
echo "==> $dir/serve: $(mib "$serve_bytes") MiB; with the checkout's tracked files: $(mib $((serve_bytes + tree_bytes))) MiB of $limit_mib"
if [[ -d build/gpu-bundle ]]; then
  echo "==> $dir/with-kernels: $(mib "$icu_bytes") MiB; with build/gpu-bundle and the checkout: $(mib $((icu_bytes + kernels_bytes + tree_bytes))) MiB of $limit_mib"
else
  echo "==> $dir/with-kernels: $(mib "$icu_bytes") MiB (build/gpu-bundle not built yet: its call's total is checked when it is)"
fi
if ((serve_bytes + tree_bytes > limit_mib * 1048576)); then
  echo "error: the serving call would carry $(mib $((serve_bytes + tree_bytes))) MiB, over $limit_mib" >&2
  exit 1
fi
if ((icu_bytes + kernels_bytes + tree_bytes > limit_mib * 1048576)); then
  echo "error: the kernel bundle's call with $dir/with-kernels would carry $(mib $((icu_bytes + kernels_bytes + tree_bytes))) MiB, over $limit_mib" >&2
  exit 1
fi
echo "==> device calls: 1) carry build/gpu-bundle and $dir/with-kernels: build/gpu-bundle/run.sh \$OUT/results"
echo "                  2) at once, carry $dir/serve: $dir/serve/run.sh \$OUT/serving"
