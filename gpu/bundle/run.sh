#!/usr/bin/env bash
# The GPU check of recsys, from a bundle made by scripts/gpu-bundle.sh. Needs bash, the NVIDIA
# driver, a CUDA toolkit's NVRTC and ptxas (or PyTorch's NVRTC), and python3 (with torch for the
# peer timing; without it that part is skipped and says so). No Rust toolchain, no network.
#
#   run.sh RESULTS_DIR              device tests, whole models GPU vs CPU, timings; at most ~8 minutes
#   run.sh --dry-run RESULTS_DIR    on any machine: every binary starts and links, fixtures found
#
# RESULTS_DIR receives summary.md (the tables for docs/BENCHMARKS.md) and the raw logs: env.log,
# tests.log, bench.log, fused.json, torch.json, models.json, ncu.csv (eight files: what a device
# call brings back at most).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
[[ $# -eq 1 ]] || { echo "usage: run.sh [--dry-run] RESULTS_DIR" >&2; exit 2; }
results=$1
mkdir -p "$results"
results=$(cd "$results" && pwd)
export RECSYS_FIXTURES="$here/fixtures"
cuda_major=$(sed -n 's/^cuda bindings: //p' "$here/BUILD")
bins=(gpu_lib gpu_kernels gpu_model nvrtc_compile backend_lib gpu_bench gpu_model_bench)
failures=0
note() { echo "$*" | tee -a "$results/env.log"; }

# --- Libraries: the driver, and an NVRTC of the bundle's CUDA major version no newer than the
# driver (PTX from a newer NVRTC cannot be loaded); ptxas for the spill check.
: >"$results/env.log"
note "bundle: $(tr '\n' ';' <"$here/BUILD")"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  nvidia-smi | tee -a "$results/env.log"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.memory --format=csv \
    | tee -a "$results/env.log"
fi
# shellcheck source=nvrtc.sh
source "$here/nvrtc.sh"
choose_nvrtc "$cuda_major" "$here/bin/gpu_bench" --versions
trap 'rm -rf "$nvrtc_pin_dir"' EXIT
ptxas=${RECSYS_PTXAS:-$(command -v ptxas || true)}
for p in /usr/local/cuda/bin/ptxas "$(dirname "${chosen:-/nonexistent/x}")/../bin/ptxas"; do
  [[ -z "$ptxas" && -x "$p" ]] && ptxas=$p
done
export RECSYS_PTXAS=${ptxas:-ptxas}
note "ptxas: ${ptxas:-not found}"
python_torch=0
if command -v python3 >/dev/null 2>&1 \
  && python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  python_torch=1
  note "torch: $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)')"
else
  note "torch: not available (or no GPU for it): the torch comparison is skipped"
fi

# --- Dry run: links, starts, fixtures; then one line on the driver.
if [[ $dry_run -eq 1 ]]; then
  for b in "${bins[@]}"; do
    if ldd "$here/bin/$b" | grep -q 'not found'; then
      note "FAIL $b: unresolved libraries: $(ldd "$here/bin/$b" | grep 'not found' | tr -s ' \n' ' ')"
      failures=$((failures + 1))
    fi
  done
  for b in gpu_lib gpu_kernels gpu_model nvrtc_compile backend_lib; do
    if ! "$here/bin/$b" --list >"$results/list-$b.log" 2>&1; then
      note "FAIL $b does not start: $(tail -n3 "$results/list-$b.log")"
      failures=$((failures + 1))
    fi
  done
  cat "$results"/list-*.log >"$results/tests.log" 2>/dev/null; rm -f "$results"/list-*.log
  # The tests that need no GPU: the clear errors without one, the launch plan, the backend's refusal.
  if ! "$here/bin/gpu_kernels" >>"$results/tests.log" 2>&1 \
    || ! "$here/bin/gpu_lib" >>"$results/tests.log" 2>&1 \
    || ! "$here/bin/backend_lib" device_choice >>"$results/tests.log" 2>&1; then
    note "FAIL a test that needs no GPU failed: see tests.log"
    failures=$((failures + 1))
  fi
  for b in gpu_bench gpu_model_bench; do
    "$here/bin/$b" --dry-run >>"$results/env.log" 2>&1 || { note "FAIL $b --dry-run"; failures=$((failures + 1)); }
  done
  # The Python package imports (it needs numpy) and names a missing driver clearly.
  if ! PYTHONPATH="$here/python" python3 -c 'import recsys, sys; print("recsys", recsys.__version__)' \
    >>"$results/env.log" 2>&1; then
    note "FAIL the bundled recsys Python package does not import: see env.log"
    failures=$((failures + 1))
  fi
  if [[ $failures -ne 0 ]]; then
    echo "dry run: $failures problem(s), see $results/env.log" >&2
    exit 1
  fi
  if "$here/bin/gpu_bench" --dry-run | grep -q 'driver present'; then
    echo "dry run: bundle OK (${#bins[@]} binaries start, fixtures found); a CUDA driver is present: run without --dry-run for the device checks"
  else
    echo "dry run: bundle OK (${#bins[@]} binaries start, fixtures found); no CUDA driver present (libcuda.so.1), so no device check ran"
  fi
  exit 0
fi

# --- The device run. Each step is bounded, and all of them by one deadline (the GPU window is
# short); a failing step is recorded and the run goes on.
deadline=$((SECONDS + ${RECSYS_GPU_CHECK_SECONDS:-450}))
# A step whose name starts with "profile:" is a measurement aid: when it fails or is skipped the
# run says so but does not count it as a failed check.
profile_misses=0
step() { # step NAME SECONDS LOG COMMAND...
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((deadline - SECONDS))
  ((limit < left)) || limit=$left
  local status=0
  if ((limit < 5)); then
    echo "<== $name: skipped, out of time" | tee -a "$results/$log"
    status=1
  else
    echo "==> $name" | tee -a "$results/$log"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$results/$log" 2>&1
    status=$?
    echo "<== $name: exit $status in $((SECONDS - t0)) s" | tee -a "$results/$log"
  fi
  if [[ $status -ne 0 ]]; then
    if [[ $name == profile:* ]]; then
      profile_misses=$((profile_misses + 1))
    else
      failures=$((failures + 1))
    fi
  fi
  return 0
}
: >"$results/tests.log"
: >"$results/bench.log"
step "tests: gpu_lib" 60 tests.log "$here/bin/gpu_lib" --include-ignored
step "tests: nvrtc_compile (spill check)" 120 tests.log "$here/bin/nvrtc_compile" --include-ignored --nocapture
step "tests: gpu_kernels (device kernels against the f64 reference)" 150 tests.log \
  "$here/bin/gpu_kernels" --include-ignored --nocapture --test-threads=1
step "tests: gpu_model (whole models, every precision, against the CPU engine)" 120 tests.log \
  "$here/bin/gpu_model" --include-ignored --nocapture --test-threads=1
step "tests: backend_lib device_choice (a KIND_GPU instance built as the backend does)" 90 tests.log \
  "$here/bin/backend_lib" device_choice --include-ignored --nocapture --test-threads=1
step "tests: the Python package's device=\"cuda\" engine against its CPU engine" 120 tests.log \
  env PYTHONPATH="$here/python" python3 "$here/python_device_check.py" "$here/fixtures"
data=$(mktemp -d)
step "bench: fused kernel" 150 bench.log \
  bash -c "'$here/bin/gpu_bench' '$data' > '$results/fused.json'"
step "bench: whole models, GPU against the CPU engine" 90 bench.log \
  bash -c "'$here/bin/gpu_model_bench' > '$results/models.json'"
if [[ $python_torch -eq 1 && -s "$results/fused.json" ]]; then
  step "bench: torch.matmul + torch.topk on the same data" 120 bench.log \
    python3 "$here/gpu_bench_torch.py" "$data" "$results/fused.json" "$results/torch.json"
else
  echo "torch comparison skipped (no torch with a GPU, or no fused results)" | tee -a "$results/bench.log"
fi
rm -rf "$data"
# --- Nsight Compute over a few cells (one process each: `gpu_bench --profile`, whose second call
# is the one read): each kernel's time, DRAM bytes and throughput, SM throughput, achieved
# occupancy and registers, with the profiler's clock control off (the card as found). Merged into
# ncu.csv with the cell in the first column; summary.py tabulates it.
ncu_bin=${RECSYS_NCU:-$(command -v ncu || true)}
for p in /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu; do
  [[ -z "$ncu_bin" && -x "$p" ]] && ncu_bin=$p
done
if [[ -n "$ncu_bin" ]]; then
  metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
  metrics+=,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active
  metrics+=,launch__registers_per_thread,launch__grid_size,smsp__inst_executed.sum
  profiles=$(mktemp -d)
  for cell in fp32:64:1:coalesced-threshold fp16:64:1:coalesced-threshold int8:64:1:coalesced-threshold \
    fp32:64:64:coalesced-threshold fp16:64:64:coalesced-threshold int8:64:64:coalesced-threshold \
    fp16:600:64:coalesced-threshold fp32:64:1:tiles; do
    step "profile: Nsight Compute, $cell" 60 bench.log bash -c "'$ncu_bin' --clock-control none \
      --target-processes all --csv --page raw --print-units base --metrics $metrics \
      '$here/bin/gpu_bench' --profile $cell > '$profiles/${cell//:/_}.csv'"
  done
  python3 - "$profiles" "$results/ncu.csv" <<'MERGE' 2>>"$results/bench.log" || note "merging the profiles failed"
import csv, io, sys
from pathlib import Path
rows = []
for f in sorted(Path(sys.argv[1]).glob("*.csv")):
    lines = [l for l in f.read_text(errors="replace").splitlines() if l.startswith('"')]
    table = list(csv.reader(io.StringIO("\n".join(lines))))
    if not table:
        continue
    if not rows:
        rows.append(["cell"] + table[0])
    cell = f.stem.replace("_", ":")
    rows += [[cell] + r for r in table[1:]]
with open(sys.argv[2], "w", newline="") as out:
    csv.writer(out).writerows(rows)
MERGE
  rm -rf "$profiles"
else
  echo "Nsight Compute (ncu) not found: no profile" | tee -a "$results/bench.log"
fi
python3 "$here/summary.py" "$results" >"$results/summary.md" 2>>"$results/bench.log" \
  || echo "summary.py failed: see bench.log" >>"$results/summary.md"
cat "$results/summary.md"
missing=""
((profile_misses == 0)) || missing=" ($profile_misses profile(s) missing)"
echo "GPU check: $failures step(s) failed$missing; results in $results"
[[ $failures -eq 0 ]]
