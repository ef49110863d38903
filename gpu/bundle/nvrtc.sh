# Sourced by the GPU bundles' scripts (run.sh, serving/serve.sh): chooses the NVRTC that the recsys
# GPU path will open and puts it first on the library path.
#
#   choose_nvrtc MAJOR PROBE...
#
# finds every libnvrtc.so.MAJOR* (the toolkit's, PyTorch's nvidia/*/lib, the linker cache's), asks
# each its version through PROBE (a command that prints "nvrtc X.Y" for the NVRTC it opens:
# `gpu_bench --versions`), and keeps the newest that the driver can load (PTX from a newer NVRTC
# cannot be). Sets driver_cuda (from nvidia-smi; empty without a driver), chosen, chosen_version
# and nvrtc_pin_dir (a temporary folder: the caller removes it), exports LD_LIBRARY_PATH, and logs
# through the caller's `note`.
choose_nvrtc() {
  local cuda_major=$1
  shift
  driver_cuda=""
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    driver_cuda=$(nvidia-smi | grep -o 'CUDA Version: [0-9.]*' | awk '{print $3}')
  fi
  local dirs=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib)
  if command -v python3 >/dev/null 2>&1; then
    while IFS= read -r d; do dirs+=("$d"); done < <(python3 -c '
import glob, os
try:
    import nvidia
    for root in nvidia.__path__:
        for lib in glob.glob(os.path.join(root, "*", "lib")):
            print(lib)
except ImportError:
    pass
' 2>/dev/null)
  fi
  local line
  while IFS= read -r line; do dirs+=("$(dirname "${line##* => }")"); done \
    < <(ldconfig -p 2>/dev/null | grep 'libnvrtc\.so\.')
  # cudarc opens "libnvrtc.so" before "libnvrtc.so.<major>", so the chosen library is pinned by a
  # link of that name in a folder put first on the library path (its own folder follows, for the
  # builtins library it loads).
  nvrtc_pin_dir=$(mktemp -d)
  local base_library_path=${LD_LIBRARY_PATH:-} file version d f
  chosen="" chosen_version=""
  while IFS= read -r file; do
    ln -sf "$file" "$nvrtc_pin_dir/libnvrtc.so"
    ln -sf "$file" "$nvrtc_pin_dir/libnvrtc.so.$cuda_major"
    version=$(LD_LIBRARY_PATH="$nvrtc_pin_dir:$(dirname "$file"):$base_library_path" \
      "$@" 2>/dev/null | sed -n 's/^nvrtc \([0-9.]*\).*/\1/p')
    note "NVRTC found: ${version:-unusable} at $file"
    [[ -n "$version" ]] || continue
    if [[ -z "$driver_cuda" ]] || nvrtc_version_le "$version" "$driver_cuda"; then
      if [[ -z "$chosen" ]] || nvrtc_version_le "$chosen_version" "$version"; then
        chosen=$file chosen_version=$version
      fi
    fi
  done < <(for d in "${dirs[@]}"; do
    for f in "$d"/libnvrtc.so."$cuda_major"*; do
      [[ -e "$f" ]] && readlink -f "$f"
    done
  done | sort -u)
  if [[ -n "$chosen" ]]; then
    ln -sf "$chosen" "$nvrtc_pin_dir/libnvrtc.so"
    ln -sf "$chosen" "$nvrtc_pin_dir/libnvrtc.so.$cuda_major"
    export LD_LIBRARY_PATH="$nvrtc_pin_dir:$(dirname "$chosen"):$base_library_path"
    note "NVRTC used: $chosen_version ($chosen)${driver_cuda:+; the driver supports CUDA $driver_cuda}"
  else
    rm -f "$nvrtc_pin_dir/libnvrtc.so" "$nvrtc_pin_dir/libnvrtc.so.$cuda_major"
    note "NVRTC: no usable libnvrtc.so.$cuda_major* no newer than the driver's CUDA ${driver_cuda:-(no driver)} was found"
  fi
}

nvrtc_version_le() { [[ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n1)" == "$1" ]]; }
