#!/usr/bin/env bash
# Runs every check CI runs: formatting, lints, and the whole test suite (unit, PyTorch parity,
# import errors, CLI end to end). Installs nothing outside the repository's own build.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "==> cargo fmt --check"
cargo fmt --all -- --check
echo "==> cargo clippy -D warnings"
cargo clippy --locked --workspace --all-targets -- -D warnings
echo "==> cargo test"
cargo test --locked --workspace
