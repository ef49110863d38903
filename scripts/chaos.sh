#!/usr/bin/env bash
# The release path's fault-injection suite, as a long run (CI runs a few seeds of it through
# tests/integration/test_chaos.py):
#   scripts/chaos.sh --seeds 500            seeds 1..500, a line each, a summary at the end
#   scripts/chaos.sh --seed 17              replay one seed (the same schedule and faults)
#   scripts/chaos.sh --seeds 50 --first 501 --summary build/chaos/summary.json
# Builds `recsys` with --features fault-injection into build/chaos/recsys (the shipped binary is
# left as it is), the backend the tests use, and the test venv (scripts/python-env.sh) if needed.
# Everything binds 127.0.0.1 and stops by itself; each seed is bounded in time.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/python-env.sh
./scripts/build-release.sh >/dev/null
cargo build --release --locked -p recsys-backend -p recsys-cli -p recsys-secret-args \
  --features recsys-cli/fault-injection
mkdir -p build/chaos/backends/recsys
cp target/release/recsys build/chaos/recsys
cp target/release/libtriton_recsys.so build/chaos/backends/recsys/
# The shipped recsys back in target/release (the build above replaced it).
./scripts/build-release.sh >/dev/null
root=$PWD
cd tests/integration
RECSYS_CALLER_DIR=$root exec "$root/.venv/bin/python" chaos.py --recsys "$root/build/chaos/recsys" \
  --plain-recsys "$root/target/release/recsys" --backend-dir "$root/build/chaos/backends" "$@"
