"""Serving benchmark: the real perf_analyzer against the real tritonserver serving the demo models
through the recsys backend. Bounded: every perf_analyzer run has a time limit, and the server is
always stopped.

    scripts/bench.sh serving [--protocols http,grpc] [--concurrency 1,8] [--out FILE.md]

Requests replay real histories (the first 256 users of the fixture test set, 5 to ~300 items,
ragged). Prints a markdown table: throughput, p50/p99 latency, and the share of the client-seen
latency spent in the backend's compute (Triton's 'compute infer' over the average latency).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from triton_harness import TritonServer  # noqa: E402

PERF_ANALYZER_TIMEOUT_S = 120


def input_data(path: Path, users: int = 256) -> None:
    lines = (ROOT / "tests" / "fixtures" / "test_set.tsv").read_text().splitlines()[1 : users + 1]
    data = []
    for line in lines:
        history = [int(x) for x in line.split("\t")[2].split()]
        data.append({"ITEM_IDS": {"content": history, "shape": [len(history)]}})
    path.write_text(json.dumps({"data": data}))


PASS = re.compile(r"Pass \[\d+\] throughput: ([0-9.]+) infer/sec")


def perf_analyzer(server: TritonServer, model: str, protocol: str, concurrency: int, data: Path, out: Path,
                  window_ms: int = 2000, stability_pct: int = 20, max_trials: int = 8) -> dict:
    url = server.http_url if protocol == "http" else server.grpc_url
    cmd = [
        str(ROOT / ".venv" / "bin" / "perf_analyzer"),
        "-m", model, "-u", url, "-i", protocol,
        "--concurrency-range", f"{concurrency}:{concurrency}",
        "--input-data", str(data),
        # design.md section 6: on 2 shared cores, 2 s windows, 20 % stability, at most 8 trials.
        "-p", str(window_ms), "-s", str(stability_pct), "--max-trials", str(max_trials),
        "--percentile", "99",
        # Verbose: every window's numbers are printed, the cell's spread.
        "-v",
        "-f", str(out),
    ]
    env = dict(os.environ)
    cudart = ROOT / ".venv" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages" / "nvidia" / "cuda_runtime" / "lib"
    env["LD_LIBRARY_PATH"] = f"{cudart}:{env.get('LD_LIBRARY_PATH', '')}"
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=PERF_ANALYZER_TIMEOUT_S, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    with open(out) as f:
        row = next(csv.DictReader(f))
    if os.environ.get("RECSYS_BENCH_DEBUG"):
        print(row, file=sys.stderr)
    us = lambda k: float(row[k])  # noqa: E731
    # The CSV has no average column; its latency breakdown adds up to the average client latency.
    avg = sum(us(k) for k in ["Client Send", "Network+Server Send/Recv", "Server Queue", "Server Compute Input",
                              "Server Compute Infer", "Server Compute Output", "Client Recv"])
    windows = [float(x) for x in PASS.findall(run.stdout)]
    return {
        # Every window's throughput, the settled ones last: the cell's spread.
        "windows": windows,
        "throughput": float(row["Inferences/Second"]),
        "p50_ms": us("p50 latency") / 1000,
        "p99_ms": us("p99 latency") / 1000,
        "avg_ms": avg / 1000,
        "queue_ms": us("Server Queue") / 1000,
        "compute_ms": us("Server Compute Infer") / 1000,
        "compute_share": us("Server Compute Infer") / avg if avg else 0.0,
    }


def measure(server: TritonServer, model: str, protocol: str, concurrency: int, data: Path, out: Path) -> dict:
    """One cell of a table, never an exception: perf_analyzer's usual windows (2 s, 20 %); on a
    noisy machine where those do not settle, 4 s windows within 30 %; if those do not settle
    either, three 4 s windows taken as they come, marked `unstable` with their spread. A cell
    perf_analyzer cannot measure at all is marked `failed` with the reason, and the run goes on."""
    print(f"perf_analyzer {model} {protocol} concurrency {concurrency} ...", file=sys.stderr, flush=True)
    try:
        return perf_analyzer(server, model, protocol, concurrency, data, out)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"  unstable, retrying with longer windows: {str(e).splitlines()[-1]}", file=sys.stderr)
    try:
        return perf_analyzer(server, model, protocol, concurrency, data, out, window_ms=4000, stability_pct=30)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"  still unstable, taking three windows as they come: {str(e).splitlines()[-1]}", file=sys.stderr)
    try:
        # A band of 1000 % accepts any three windows: the cell is the measurement, not a settled one.
        result = perf_analyzer(server, model, protocol, concurrency, data, out, window_ms=4000,
                               stability_pct=1000, max_trials=3)
        result["unstable"] = True
        return result
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        print(f"  failed: {reason}", file=sys.stderr)
        return {"failed": reason}


def cell(result: dict, key: str, scale: float = 1.0, digits: int = 3) -> str:
    """A number of a measured cell, or what the cell is instead."""
    if "failed" in result:
        return "failed"
    return f"{result[key] * scale:.{digits}f}"


def spread(result: dict) -> str:
    """How far a cell's windows spread (min-max infer/s), and whether it settled."""
    if "failed" in result:
        return f"failed: {result['failed']}"
    windows = result.get("windows") or []
    text = f"{min(windows):.0f}-{max(windows):.0f}" if windows else "-"
    return f"UNSTABLE {text}" if result.get("unstable") else text


def ratio(a: dict, b: dict, key: str) -> str:
    if "failed" in a or "failed" in b or not b[key]:
        return "-"
    return f"{a[key] / b[key]:.2f}" + ("?" if a.get("unstable") or b.get("unstable") else "")


def main() -> None:
    parser = argparse.ArgumentParser(description="perf_analyzer against tritonserver + recsys")
    parser.add_argument("--models", default="bert4rec,vaecf")
    parser.add_argument("--protocols", default="http,grpc")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--out", type=Path, help="also write the markdown table to this file")
    args = parser.parse_args()

    backend = ROOT / "build" / "backends"
    if not (backend / "recsys" / "libtriton_recsys.so").exists():
        sys.exit("build/backends/recsys/libtriton_recsys.so is missing: run scripts/bench.sh serving")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "histories.json"
        input_data(data)
        with TritonServer(ROOT / "model_repository", backend, log_path=tmp / "server.log") as server:
            for model in args.models.split(","):
                for protocol in args.protocols.split(","):
                    for c in [int(x) for x in args.concurrency.split(",")]:
                        r = measure(server, model, protocol, c, data, tmp / f"{model}-{protocol}-{c}.csv")
                        rows.append((model, protocol, c, r))
    header = (
        f"{datetime.date.today().isoformat()}, {platform.node()}: {os.cpu_count()} cores, tritonserver 2.51.0, "
        f"perf_analyzer -p 2000 -s 20 --max-trials 8, 256 real histories (ragged)\n\n"
        "| model | protocol | concurrency | infer/s | windows infer/s | p50 ms | p99 ms | avg ms | server queue ms | backend compute ms | compute share |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    table = header + "".join(
        f"| {m} | {p} | {c} | {cell(r, 'throughput', digits=0)} | {spread(r)} | {cell(r, 'p50_ms')} | "
        f"{cell(r, 'p99_ms')} | {cell(r, 'avg_ms')} | {cell(r, 'queue_ms')} | {cell(r, 'compute_ms')} | "
        f"{cell(r, 'compute_share', 100, 0)} % |\n"
        for m, p, c, r in rows
    ) + "\nwindows: each perf_analyzer window's throughput (min-max); UNSTABLE: no 3 windows settled within 30 % "
    table += "(the cell is three windows as they came; its ratios carry a '?').\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
