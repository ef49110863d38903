#!/usr/bin/env bash
# Runs every check CI runs, installing what it needs (the Python venv with the real tritonserver and
# tritonclient): formatting, lints, the Rust test suite (unit, PyTorch parity, import errors, CLI end
# to end), the README's main command in --check mode, and the integration tests against a real
# tritonserver and the Python package. Ends with one "N passed, N failed" line over everything.
set -euo pipefail
cd "$(dirname "$0")/.."

logs=$(mktemp -d)
# Each stage's line says how long the run has taken so far: CI's budget is an hour, and the stage
# that grows is the one to look at.
stage() { printf '==> [%dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }
trap 'rm -rf "$logs"' EXIT
# Sums the "N <word>" counts ($2: passed, failed, error) on the summary lines ($3, a regex) of log $1.
count() {
  local n
  n=$(grep -E "$3" "$1" | grep -oE "[0-9]+ $2" | awk '{s+=$1} END {print s+0}') || true
  echo "${n:-0}"
}

# The CUDA emulation tests compile the kernel sources as host C++.
if ! command -v "${RECSYS_CXX:-c++}" >/dev/null; then
  if [[ $(id -u) -eq 0 ]]; then
    apt-get update -qq && apt-get install -y -qq g++ >/dev/null
  else
    echo "error: the CUDA emulation tests need a C++17 compiler: sudo apt-get install g++ (or set RECSYS_CXX)" >&2
    exit 1
  fi
fi

# The FFI drift test runs bindgen over Triton's headers; bindgen loads libclang at run time.
# (libclang itself: libclang-cpp, which some images carry alone, is not what bindgen loads.)
if ! compgen -G "/usr/lib/llvm-*/lib/libclang.so*" >/dev/null \
  && ! compgen -G "/usr/lib/llvm-*/lib/libclang-[0-9]*.so*" >/dev/null \
  && ! ldconfig -p | grep -qE 'libclang(-[0-9.]+)?\.so'; then
  if [[ $(id -u) -eq 0 ]]; then
    apt-get update -qq && apt-get install -y -qq libclang-dev >/dev/null
  else
    echo "error: the FFI drift test needs libclang: sudo apt-get install libclang-dev" >&2
    exit 1
  fi
fi
# ... over the headers of the registry package triton-sys 0.2.0 (fetched into cargo's cache).
./scripts/triton-headers.sh >/dev/null

# The Python environment (mostly downloads) is made in the background while the Rust build uses
# the cores (after the apt installs above: it runs apt itself at its end); the first step that
# needs it waits for it.
stage "Python environment (scripts/python-env.sh, in the background until the CUDA step needs it)"
./scripts/python-env.sh >"$logs/python-env.log" 2>&1 &
python_env=$!
wait_for_python_env() {
  if ! wait "$python_env"; then
    cat "$logs/python-env.log" >&2
    echo "error: scripts/python-env.sh failed (its output is above)" >&2
    exit 1
  fi
  cat "$logs/python-env.log"
}

# The AMX kernels' tests also run on an emulated Sapphire Rapids (scripts/amx-emulator.sh): its
# tools are installed here, before the background jobs' apt runs, and the emulator is built in
# the background at low priority while the Rust build uses the cores.
./scripts/amx-emulator.sh --install-tools
stage "AMX emulator (scripts/amx-emulator.sh --prepare, in the background)"
nice -n 10 ./scripts/amx-emulator.sh --prepare >"$logs/amx-emulator.log" 2>&1 &
amx_emulator=$!

# The kernel tests run on every ISA the CPU has; here the AVX2 path must be among them.
export REQUIRE_AVX2=1

stage "cargo fmt --check"
cargo fmt --all -- --check
stage "cargo clippy -D warnings"
cargo clippy --locked --workspace --all-targets -- -D warnings
cargo clippy --locked -p recsys-registry -p recsys-cli --features recsys-cli/fault-injection --all-targets -- -D warnings

stage "cargo test"
rust_status=0
# The benches crate's programs are type-checked by clippy above and built in release by
# scripts/bench.sh; building them here would build criterion and its plotting stack for nothing.
cargo test --locked --workspace --exclude recsys-benches --lib --bins --tests 2>&1 | tee "$logs/rust.log" || rust_status=$?
stage "PyTorch parity again on the portable scalar kernels (the run above uses the best ISA)"
# --workspace: the features resolved as for the run above, so nothing builds again.
RECSYS_FORCE_ISA=scalar cargo test --locked --workspace --exclude recsys-benches --test golden_parity --test sequential_parity 2>&1 | tee -a "$logs/rust.log" || rust_status=$?

stage "AMX kernels on an emulated Sapphire Rapids (scripts/amx-emulator.sh)"
if wait "$amx_emulator"; then
  amx_tests=$(cargo test --locked -p recsys-kernels --test amx --no-run --message-format=json 2>/dev/null |
    grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -1)
  RECSYS_REQUIRE_AMX=1 ./scripts/amx-emulator.sh "$amx_tests" --test-threads=1 2>&1 |
    tee -a "$logs/rust.log" || rust_status=1
else
  cat "$logs/amx-emulator.log" >&2
  echo "error: the AMX emulator could not be prepared (its output is above)" >&2
  rust_status=1
fi

stage "waiting for the Python environment"
wait_for_python_env
stage "CUDA kernels: NVRTC compile for sm_80 and sm_90, ptxas spill check, clean load errors (no GPU needed)"
# The spill check runs on NVRTC 12.6 (the oldest 12.x the CUDA 12 build takes), 12.9 (the newest
# 12.x) and, with the CUDA 13 bindings, 13.0 (the GPU machine's toolkit; below); each run checks
# that the NVRTC it opened is the one named.
nvidia_dir=$(.venv/bin/python -c 'import nvidia, os; print(list(nvidia.__path__)[0])')
# Only the test binaries the feature adds: the emulated kernels and models already ran above.
LD_LIBRARY_PATH="$nvidia_dir/cuda_nvrtc/lib:${LD_LIBRARY_PATH:-}" RECSYS_PTXAS="$nvidia_dir/cuda_nvcc/bin/ptxas" \
  RECSYS_EXPECT_NVRTC=12.6 cargo test --locked -p recsys-gpu --features cuda-12 --lib \
  --test nvrtc_compile --test gpu_kernels --test gpu_model 2>&1 | tee -a "$logs/rust.log" || rust_status=$?
LD_LIBRARY_PATH="$PWD/.venv/cuda-12.9/nvidia/cuda_nvrtc/lib:${LD_LIBRARY_PATH:-}" \
  RECSYS_PTXAS=$PWD/.venv/cuda-12.9/nvidia/cuda_nvcc/bin/ptxas RECSYS_EXPECT_NVRTC=12.9 \
  cargo test --locked -p recsys-gpu --features cuda-12 --test nvrtc_compile 2>&1 | tee -a "$logs/rust.log" || rust_status=$?
cargo clippy --locked -p recsys-gpu -p recsys-backend -p recsys-python --features recsys-gpu/cuda-12,recsys-backend/cuda,recsys-python/cuda-12 --all-targets -- -D warnings
cargo clippy --locked -p recsys-gpu -p recsys-backend -p recsys-python --features recsys-gpu/cuda-13,recsys-backend/cuda-13,recsys-python/cuda-13 --all-targets -- -D warnings

# The GPU bundle (release binaries with the CUDA 13 bindings and the Python package, about eleven
# minutes of building here) is built and dry-run where it is used: before a GPU machine is lent
# (scripts/gpu-bundle.sh checks its size budget; RECSYS_TEST_GPU_BUNDLE=1 runs that here too). CI
# runs the spill check on NVRTC 13.0 from the CUDA 13 build of the same test.
if [[ "${RECSYS_TEST_GPU_BUNDLE:-0}" == 1 ]]; then
  stage "GPU bundle (CUDA 13): build, size budget, dry run; the spill check on NVRTC 13.0 from its binary"
  ./scripts/gpu-bundle.sh build/gpu-bundle --cuda 13
  rm -rf build/gpu-bundle-dry-run
  build/gpu-bundle/run.sh --dry-run build/gpu-bundle-dry-run 2>&1 | tee -a "$logs/rust.log" || rust_status=$?
  rm -rf build/gpu-bundle-unpacked
  build/gpu-bundle/run.sh --unpack build/gpu-bundle-unpacked || rust_status=$?
  nvrtc13=(build/gpu-bundle-unpacked/bin/nvrtc_compile --nocapture)
else
  stage "the spill check on NVRTC 13.0 (the GPU machine's toolkit), CUDA 13 bindings"
  nvrtc13=(cargo test --locked -p recsys-gpu --features cuda-13 --test nvrtc_compile)
fi
LD_LIBRARY_PATH="$PWD/.venv/cuda-13.0/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}" \
  RECSYS_PTXAS=$PWD/.venv/cuda-13.0/nvidia/cu13/bin/ptxas RECSYS_EXPECT_NVRTC=13.0 \
  "${nvrtc13[@]}" 2>&1 | tee -a "$logs/rust.log" || rust_status=$?

stage "Dockerfile lint"
.venv/bin/hadolint docker/Dockerfile docker/Dockerfile.cpu

stage "the user guide builds (mdBook; cli/tests checks its links and flags, tests/integration/test_guide.py runs its commands)"
.venv/bin/mdbook build docs/guide

# Fuzzing itself (fuzz/run.sh 600: AddressSanitizer builds of every target and their dependencies,
# then minutes per target) is a campaign of its own, not a per-change check; what it found lives on
# as regression tests in the suites above. Here the targets are type-checked, so they never rot.
stage "fuzz targets: type check (fuzz/run.sh 600 is the fuzzing run)"
RUSTFLAGS="--cfg fuzzing" CARGO_TARGET_DIR=target/fuzz-check cargo check --locked --manifest-path fuzz/Cargo.toml --bins

stage "the README's main command, in --check mode (builds, converts, serves, runs the examples, stops)"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
HTTP_PORT=$(free_port) GRPC_PORT=$(free_port) METRICS_PORT=$(free_port) ./scripts/serve.sh --check

stage "integration tests against the real tritonserver"
# Every release build below names the CLI with the backend, as scripts/serve.sh's build above
# does: cargo unifies the dependencies' features over the packages of one build, so the backend
# built alone would compile its whole dependency tree again with another feature set (minutes
# here); built beside the CLI, only the crates whose own features differ build again.
# The backend under test is built with the test-only panic trigger, into its own backend directory.
cargo build --release --locked -p recsys-backend -p recsys-cli --features recsys-backend/panic-trigger
mkdir -p build/test-backends/recsys
cp target/release/libtriton_recsys.so build/test-backends/recsys/
# The CUDA build, as docker/Dockerfile builds it, for the KIND_GPU tests (a clear load error here).
# In the one release target folder: only the crates whose features differ build again.
./scripts/build-release.sh --cuda
mkdir -p build/test-backends-cuda/recsys
cp target/release/libtriton_recsys.so build/test-backends-cuda/recsys/
# The release path's fault-injection suite (test_chaos.py) runs `recsys` built with its fault hooks
# (RECSYS_FAULTS; never shipped) from build/chaos; the shipped binary goes back in place after.
cargo build --release --locked -p recsys-backend -p recsys-cli -p recsys-secret-args \
  --features recsys-cli/fault-injection
mkdir -p build/chaos
cp target/release/recsys build/chaos/recsys
./scripts/build-release.sh
# The Python package as users get it: the abi3 wheel (PyO3, built by maturin from PyPI in pip's
# build environment; it reuses the release build of the engine above), installed for
# tests/integration/test_python.py and test_ray.py.
rm -rf build/wheels
wheel=$(PYTHON=.venv/bin/python scripts/build-wheel.sh build/wheels)
.venv/bin/pip install --quiet --force-reinstall --no-deps "$wheel"
py_status=0
.venv/bin/pytest tests/integration -q -p no:cacheprovider --durations=30 2>&1 | tee "$logs/py.log" || py_status=$?
# Leave the serving build of the backend in place for scripts/serve.sh and the benchmarks.
cargo build --release --locked -p recsys-cli -p recsys-backend >/dev/null 2>&1 || true

rust_passed=$(count "$logs/rust.log" passed '^test result:')
rust_failed=$(count "$logs/rust.log" failed '^test result:')
py_passed=$(count "$logs/py.log" passed '(passed|failed|error).* in [0-9.]+s')
py_failed=$(count "$logs/py.log" failed '(passed|failed|error).* in [0-9.]+s')
py_errors=$(count "$logs/py.log" error '(passed|failed|error).* in [0-9.]+s')
echo
stage "done"
echo "rust: ${rust_passed} passed, ${rust_failed} failed; integration: ${py_passed} passed, $((py_failed + py_errors)) failed"
echo "all: $((rust_passed + py_passed)) passed, $((rust_failed + py_failed + py_errors)) failed"
if [[ $rust_status -ne 0 || $py_status -ne 0 ]]; then exit 1; fi
