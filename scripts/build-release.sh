#!/usr/bin/env bash
# The release build of what gets deployed: the Triton backend and the CLI. `--cuda` adds the GPU path
# (KIND_GPU instances) for a CUDA 12 toolkit on the serving machine (tritonserver 24.10's), `--cuda-13`
# for CUDA 13; CUDA is loaded at run time, so the build needs no CUDA toolkit. Used by CI
# (scripts/test.sh) and by docker/Dockerfile, so the image is built exactly as CI builds.
#   scripts/build-release.sh [--cuda | --cuda-13] [--backend-only] [--target-dir DIR]
# --backend-only leaves out the CLI (it has no CUDA features, so its CUDA build is the plain one).
# In a target folder that already holds the CLI's release build, building with the CLI is the
# faster one: the dependencies keep the feature set they were built with. With the CLI, its shell
# completions and manual pages are written to target/release/completions and target/release/man.
set -euo pipefail
cd "$(dirname "$0")/.."
features=()
args=()
packages=(-p recsys-backend -p recsys-cli -p recsys-secret-args)
while [[ $# -gt 0 ]]; do
  case $1 in
    --cuda) features=(--features recsys-backend/cuda-12); shift ;;
    --cuda-13) features=(--features recsys-backend/cuda-13); shift ;;
    --target-dir) args+=(--target-dir "$2"); shift 2 ;;
    --backend-only) packages=(-p recsys-backend -p recsys-secret-args); shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
cargo build --release --locked "${packages[@]}" "${features[@]}" "${args[@]}"
# With the CLI: its shell completions and manual pages beside it, generated from its own command
# definitions (target/release/completions/recsys.{bash,zsh,fish}, target/release/man/*.1).
if [[ " ${packages[*]} " == *" recsys-cli "* ]]; then
  target=target
  if [[ ${#args[@]} -gt 0 && ${args[0]} == --target-dir ]]; then target=${args[1]}; fi
  bin="$target/release/recsys"
  mkdir -p "$target/release/completions"
  for shell in bash zsh fish; do
    "$bin" completions "$shell" > "$target/release/completions/recsys.$shell"
  done
  "$bin" man --output "$target/release/man" 2>/dev/null
fi
