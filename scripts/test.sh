#!/usr/bin/env bash
# Runs every check CI runs: formatting, lints, and the whole test suite (unit, PyTorch parity,
# import errors, CLI end to end). Ends with one "N passed, N failed" line over all test binaries.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "==> cargo fmt --check"
cargo fmt --all -- --check
echo "==> cargo clippy -D warnings"
cargo clippy --locked --workspace --all-targets -- -D warnings

echo "==> cargo test"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
cargo test --locked --workspace --lib --bins --tests 2>&1 | tee "$log" || status=$?
passed=$(grep -E '^test result:' "$log" | sed -E 's/.* ([0-9]+) passed.*/\1/' | awk '{s+=$1} END {print s+0}')
failed=$(grep -E '^test result:' "$log" | sed -E 's/.* ([0-9]+) failed.*/\1/' | awk '{s+=$1} END {print s+0}')
echo
echo "rust: ${passed} passed, ${failed} failed"
exit "$status"
