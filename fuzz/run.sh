#!/usr/bin/env bash
# Fuzz the four parsers with libFuzzer (cargo fuzz, nightly toolchain, AddressSanitizer).
#
#   fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]     default: 60 s each, all targets
#
# Seeds corpora from the fixtures (fuzz/seed.py), converts the fixture BERT4Rec for the `request`
# target, runs each target for the given time with a 10 s per-input timeout and a 2 GiB RSS limit,
# and prints executions and coverage per target. Crashes land in fuzz/artifacts/<target>/ and fail
# the run; each one found becomes a regression test (see fuzz/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(checkpoint engine_dir request predict_jsonl)

# cargo fuzz passes -Z flags (sanitizers): nightly when installed, else the stable toolchain with
# RUSTC_BOOTSTRAP=1 (stable ships the same sanitizer runtimes).
toolchain=${RECSYS_FUZZ_TOOLCHAIN:-nightly}
if ! cargo "+$toolchain" --version >/dev/null 2>&1; then
  toolchain=stable
  export RUSTC_BOOTSTRAP=1
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install --locked cargo-fuzz@0.12.0
fi
cargo build --release -p recsys-cli
./scripts/python-env.sh
.venv/bin/python fuzz/seed.py
# Converted by this build every run (under a second): an engine left by another build may be in a
# format this one refuses, and the targets would fail on loading it rather than on their input.
engine=fuzz/work/engine
mkdir -p fuzz/work
# With the demo item attributes, so set names in INCLUDE_ITEM_SETS / EXCLUDE_ITEM_SETS resolve too.
scripts/demo-item-attributes.sh tests/fixtures/bert4rec/item_id_map.tsv fuzz/work/attributes.tsv
target/release/recsys convert --kind bert4rec --checkpoint tests/fixtures/bert4rec/model.safetensors \
  --config tests/fixtures/bert4rec/config.json --item-map tests/fixtures/bert4rec/item_id_map.tsv \
  --item-attributes fuzz/work/attributes.tsv --out "$engine" --force >/dev/null
export RECSYS_FUZZ_ENGINE=$PWD/$engine
status=0
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
  log=fuzz/work/$t.log
  echo "== $t: ${seconds} s" >&2
  if ! (cd fuzz && cargo "+$toolchain" fuzz run "$t" "corpus/$t" "seeds/$t" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=1048576 \
        -print_final_stats=1 -artifact_prefix="artifacts/$t/") >"$log" 2>&1; then
    echo "!! $t failed; tail of $log:" >&2
    tail -40 "$log" >&2
    status=1
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 || true)
  echo "$t: $runs executions in ${seconds} s, $cov" >&2
done
exit $status
