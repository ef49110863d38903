#!/usr/bin/env bash
# The unsafe code under dynamic checkers:
#   1. AddressSanitizer + LeakSanitizer over the engine (SIMD kernels, packed layouts, mapped tensors),
#      the ONNX exporter and the backend's pure-Rust layers (decode, serve, settings): their unit and
#      integration tests, instrumented (nightly toolchain, or stable with RUSTC_BOOTSTRAP=1).
#   2. Valgrind memcheck over the engine's unit tests (kernels on the detected ISA and scalar), the
#      stand-in for Miri, which cannot run AVX2 intrinsics or memory maps and is not installed here.
# The FFI layer proper (the TRITONBACKEND_* calls) only runs inside tritonserver; it is exercised by
# the integration tests and the soak test, not instrumented here.
#   scripts/sanitizers.sh [asan|valgrind]...      default: both
set -euo pipefail
cd "$(dirname "$0")/.."
steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=(asan valgrind)
target=$(rustc -vV | sed -n 's/^host: //p')
toolchain=+nightly
if ! cargo +nightly --version >/dev/null 2>&1; then
  toolchain=+stable
  export RUSTC_BOOTSTRAP=1
fi
for step in "${steps[@]}"; do
  case $step in
    asan)
      echo "==> AddressSanitizer + LeakSanitizer ($toolchain, $target)"
      # --target keeps the sanitizer off build scripts and proc macros; a separate target dir keeps
      # the instrumented build apart from the normal one.
      RUSTFLAGS="-Zsanitizer=address -Cforce-frame-pointers=yes" \
      ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1" \
        cargo "$toolchain" test --target "$target" --target-dir target/asan \
          -p recsys-engine -p recsys-onnx -p recsys-backend --lib --tests
      ;;
    valgrind)
      echo "==> valgrind memcheck over the engine's unit tests"
      bin=$(cargo test -p recsys-engine --lib --no-run --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable")][0])')
      for isa in avx2 scalar; do
        RECSYS_FORCE_ISA=$isa valgrind --quiet --error-exitcode=1 --leak-check=full \
          --errors-for-leak-kinds=definite "$bin" --test-threads=1 -q
      done
      ;;
    *) echo "unknown step $step (asan or valgrind)" >&2; exit 2 ;;
  esac
done
