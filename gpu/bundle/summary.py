"""Writes the GPU check's summary.md from the raw results in RESULTS_DIR: every test's verdict (from
tests.log), the fused kernel against torch (fused.json, torch.json), whole models on the GPU
against the CPU engine (models.json), and the Nsight Compute profile of a few cells (ncu.csv).
Standard library only.

    python3 summary.py RESULTS_DIR > RESULTS_DIR/summary.md
"""

import csv
import json
import re
import sys
from datetime import date
from pathlib import Path


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def device_line(results: Path) -> str:
    env = (results / "env.log").read_text() if (results / "env.log").exists() else ""
    csv = [l for l in env.splitlines() if l.count(",") >= 4 and "name" not in l]
    nvrtc = [l for l in env.splitlines() if l.startswith("NVRTC used")]
    torch = [l for l in env.splitlines() if l.startswith("torch:")]
    parts = [csv[0] if csv else "GPU: unknown"] + nvrtc[:1] + torch[:1]
    return "; ".join(parts)


def test_table(results: Path) -> list:
    log = (results / "tests.log").read_text() if (results / "tests.log").exists() else ""
    rows, step = [], ""
    for line in log.splitlines():
        if line.startswith("==> "):
            step = line[4:].split(" (")[0].replace("tests: ", "")
        m = re.match(r"^test (\S+) \.\.\. (ok|FAILED|ignored)", line)
        if m:
            rows.append(f"| {step} | `{m.group(1)}` | {m.group(2)} |")
        m = re.match(r"^<== (.*): (skipped, out of time|exit (\d+).*)$", line)
        if m and (m.group(3) not in (None, "0")):
            rows.append(f"| {m.group(1).replace('tests: ', '')} | (the whole binary) | {m.group(2)} |")
    spills = [l for l in log.splitlines() if re.match(r"^sm_\d+ \S+: \d+ registers", l)]
    out = ["| binary | test | verdict |", "|---|---|---|"] + rows
    if spills:
        out += ["", "Registers and spills (ptxas, sm_90 and sm_80):", ""] + [f"- {l}" for l in spills]
    notes = [l for l in log.splitlines() if re.search(r"(same item at|rows checked|max \|score diff\|)", l)]
    if notes:
        out += ["", "Agreement reported by the tests:", ""] + [f"- {l.strip()}" for l in notes]
    return out


def fused_table(results: Path) -> list:
    fused, torch = load(results / "fused.json"), load(results / "torch.json")
    if not fused:
        return ["(no fused-kernel results: see bench.log)"]
    peer = {}
    if torch:
        peer = {(r["precision"], r["dim"], r["batch"]): r["torch_ms"] for r in torch["rows"]}
    copy = fused["copy_gb_s"]
    out = [
        f"N = {fused['n']:,} items, k = {fused['k']}; device-to-device copy bandwidth measured in the "
        f"same run: {copy:.0f} GB/s. Kernel times are CUDA events around the GPU work on both sides; "
        "end-to-end includes copying the hidden vectors in and the top-k out. int8 is compared with "
        "torch's fp16 matmul (torch has no int8 GEMV).",
        "",
        "| precision | d | batch | scan | fused kernel ms | torch matmul+topk ms | speed-up | fused end-to-end ms "
        "| GB/s (compulsory bytes) | share of copy bandwidth |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in fused["fused"]:
        t = peer.get((e["precision"], e["dim"], e["batch"]))
        speed = f"{t / e['kernel_ms']:.2f}x" if t else "n/a"
        out.append(
            f"| {e['precision']} | {e['dim']} | {e['batch']} | {e.get('scan', 'tiles')} | {e['kernel_ms']:.3f} | "
            f"{f'{t:.3f}' if t else 'skipped'} | {speed} | {e['end_to_end_ms']:.3f} | "
            f"{e['achieved_gb_s']:.0f} | {100 * e['achieved_gb_s'] / copy:.0f} % |"
        )
    return out


def model_table(results: Path) -> list:
    models = load(results / "models.json")
    if not models:
        return ["(no whole-model results: see bench.log)"]
    floor = models.get("round_trip_ms")
    out = [
        f"{models['device']}; trained fixtures, top-10 with the history excluded; median of 30; "
        "CPU engine in the same process with its default threads. GPU encoder ms: the encoder's "
        "kernels alone, to the stream's end; launches, copies (in/out) and allocations: what one "
        "call asks of the device"
        + (f"; one value up and back (the floor of any call that waits for the GPU): {floor:.3f} ms."
           if floor is not None else "."),
        "",
        "| model | precision | batch | CPU engine ms | GPU ms | GPU speed-up | GPU encoder ms | launches "
        "| copies in/out | allocations | identical top-10 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in models["models"]:
        encoder = f"{m['gpu_encode_ms']:.3f}" if "gpu_encode_ms" in m else "n/a"
        copies = f"{m['copies_in']}/{m['copies_out']}" if "copies_in" in m else "n/a"
        out.append(
            f"| {m['model']} | {m['precision']} | {m['batch']} | {m['cpu_ms']:.3f} | {m['gpu_ms']:.3f} | "
            f"{m['cpu_ms'] / m['gpu_ms']:.2f}x | {encoder} | {m.get('launches', 'n/a')} | {copies} | "
            f"{m.get('allocations', 'n/a')} | {100 * m['identical_top10']:.0f} % |"
        )
    return out


def number(value: str) -> float:
    try:
        return float(value.replace(",", ""))
    except ValueError:
        return float("nan")


def profile_table(results: Path) -> list:
    """Each profiled cell's kernels, from the second of its two calls (the buffers already kept)."""
    try:
        with open(results / "ncu.csv", newline="") as f:
            table = list(csv.DictReader(f))
    except OSError:
        return ["(no profile: Nsight Compute was not found or failed; see bench.log)"]
    calls = {}
    for row in table:
        if not row.get("ID", "").strip():
            continue  # the units row
        calls.setdefault(row["cell"], []).append(row)
    out = [
        "Nsight Compute, clock control off; each cell's second call (every buffer already kept). DRAM "
        "GB/s = bytes read from DRAM over the kernel's time; % of peak as the profiler reports them.",
        "",
        "| cell | kernel | µs | DRAM read MB | DRAM GB/s | DRAM % peak | SM % peak | occupancy % | registers | grid |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell, rows in calls.items():
        # Two calls of the same launches: the second half is the second call.
        for row in rows[len(rows) // 2:]:
            ns = number(row.get("gpu__time_duration.sum", ""))
            read = number(row.get("dram__bytes_read.sum", ""))
            out.append(
                f"| {cell} | `{row.get('Kernel Name', '?')}` | {ns / 1e3:.1f} | {read / 1e6:.1f} | "
                f"{read / ns:.0f} | {number(row.get('dram__throughput.avg.pct_of_peak_sustained_elapsed', '')):.0f} | "
                f"{number(row.get('sm__throughput.avg.pct_of_peak_sustained_elapsed', '')):.0f} | "
                f"{number(row.get('sm__warps_active.avg.pct_of_peak_sustained_active', '')):.0f} | "
                f"{row.get('launch__registers_per_thread', '?')} | {row.get('launch__grid_size', '?')} |"
            )
    return out


def main() -> None:
    results = Path(sys.argv[1])
    lines = [
        f"# GPU check, {date.today().isoformat()}",
        "",
        device_line(results),
        "",
        "## Device tests",
        "",
        *test_table(results),
        "",
        "## Fused score + top-k against torch.matmul + torch.topk",
        "",
        *fused_table(results),
        "",
        "## Whole models: GPU against the CPU engine",
        "",
        *model_table(results),
        "",
        "## Where the fused kernels' time goes (Nsight Compute)",
        "",
        *profile_table(results),
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
