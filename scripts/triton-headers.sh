#!/usr/bin/env bash
# Prints the include directory of Triton's C API headers (tritonbackend.h, tritonserver.h) as the
# registry package triton-sys 0.2.0 ships them (triton-inference-server/core at backend API 1.16,
# server API 1.25), fetching the package into cargo's registry cache if it is not there yet. The
# FFI drift test (ffi/tests/header_drift.rs) compares ffi/ with them; nothing is copied into the repo
# and nothing in the build needs them.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.2.0
find_include() {
  local d
  for d in "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/triton-sys-$version/deps/core/include; do
    [[ -f "$d/triton/core/tritonbackend.h" ]] && { echo "$d"; return 0; }
  done
  return 1
}
if ! find_include; then
  probe=build/triton-headers
  mkdir -p "$probe/src"
  printf '[package]\nname = "triton-headers-probe"\nversion = "0.0.0"\nedition = "2021"\npublish = false\n\n[dependencies]\ntriton-sys = "=%s"\n\n[workspace]\n' "$version" >"$probe/Cargo.toml"
  echo 'fn main() {}' >"$probe/src/main.rs"
  # Only downloads and unpacks the package (its build script, which needs libclang, is not run).
  cargo fetch -q --manifest-path "$probe/Cargo.toml" >&2
  find_include
fi
