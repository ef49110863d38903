"""Serving benchmark against the peer, and the dynamic-batching study, with the real perf_analyzer.

    scripts/bench.sh peers [--models bert4rec,vaecf] [--concurrency 1,4,8,16] [--skip-batching] [--out FILE.md]

One tritonserver serves, from a temporary repository:
  - <model>: the recsys backend on the demo engine (model_repository/<model>/1), as shipped;
  - <model>_peer, <model>_peer_ov, <model>_peer_ovd: the same engine exported with `recsys
    export-onnx --k 10`, run by Triton's Python backend (benches/triton_peer/model.py) in onnxruntime,
    in OpenVINO with f32 forced and in OpenVINO at its default precision; same inputs/outputs, same
    dynamic batching (100 us), one instance, one intra-op thread (recsys: one scoring thread);
  - <model>_q<delay>[_pref]: recsys with max_queue_delay_microseconds 0/100/500/2000, without and with
    preferred_batch_size [8, 16] (the batching study, at the highest concurrency).
Every perf_analyzer run is bounded (2 s windows, at most 8 trials, a timeout) and the server is always
stopped. Requests replay the first 256 fixture users' real histories (ragged), gRPC.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from bench_serving import cell, input_data, ratio, spread  # noqa: E402
from bench_serving import measure as measure_cell  # noqa: E402
from triton_harness import TritonServer  # noqa: E402

DELAYS_US = [0, 100, 500, 2000]
PREFERRED = [8, 16]


def recsys_config(name: str, source: str, delay_us: int, preferred: list[int] | None) -> str:
    text = (ROOT / "model_repository" / source / "config.pbtxt").read_text()
    text = text.replace(f'name: "{source}"', f'name: "{name}"')
    batching = f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us}"
    if preferred:
        batching += f" preferred_batch_size: [ {', '.join(map(str, preferred))} ]"
    batching += " }"
    lines = [batching if line.startswith("dynamic_batching") else line for line in text.splitlines()]
    return "\n".join(lines) + "\n"


PEER_CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 64
input [
  {{ name: "ITEM_IDS" data_type: TYPE_INT64 dims: [ -1 ] allow_ragged_batch: true }},
  {{ name: "K" data_type: TYPE_INT32 dims: [ 1 ] optional: true }},
  {{ name: "EXCLUDE_ITEM_IDS" data_type: TYPE_INT64 dims: [ -1 ] optional: true allow_ragged_batch: true }}
]
output [
  {{ name: "TOP_ITEM_IDS" data_type: TYPE_INT64 dims: [ -1 ] }},
  {{ name: "TOP_SCORES" data_type: TYPE_FP32 dims: [ -1 ] }}
]
dynamic_batching {{ max_queue_delay_microseconds: 100 }}
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
parameters [ {{ key: "top_k" value {{ string_value: "10" }} }}, {{ key: "threads" value {{ string_value: "1" }} }}{runtime} ]
"""
# The Python-backend peer's own parameters (benches/triton_peer/model.py).
RUNTIME_PARAMETERS = """,
  {{ key: "runtime" value {{ string_value: "{runtime}" }} }}, {{ key: "precision" value {{ string_value: "{precision}" }} }},
  {{ key: "site_packages" value {{ string_value: "{site}" }} }}"""

def peer_config(name: str, runtime: str | None = "onnxruntime", precision: str = "f32") -> str:
    """The Python-backend peer's config.pbtxt (the runtimes' folder from RECSYS_PEER_SITE); with
    `runtime` None, only what the recsys backend shares with it (the serving benchmarks derive the
    recsys model's config from it)."""
    extra = "" if runtime is None else RUNTIME_PARAMETERS.format(
        runtime=runtime, precision=precision, site=os.environ.get("RECSYS_PEER_SITE", ""))
    return PEER_CONFIG.format(name=name, runtime=extra)


# The peers: (model-name suffix, label, runtime, precision).
PEERS = [("_peer", "Python + ORT", "onnxruntime", "f32"), ("_peer_ov", "Python + OpenVINO f32", "openvino", "f32"),
         ("_peer_ovd", "Python + OpenVINO default", "openvino", "default")]


def backend_directory(tmp: Path) -> Path:
    """recsys next to pytriton's Python backend, with the stub for this interpreter's version."""
    import pytriton  # noqa: PLC0415

    server_dir = Path(pytriton.__file__).parent / "tritonserver"
    backends = tmp / "backends"
    shutil.copytree(ROOT / "build" / "backends" / "recsys", backends / "recsys")
    shutil.copytree(server_dir / "backends" / "python", backends / "python")
    stub = server_dir / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / "triton_python_backend_stub"
    shutil.copy2(stub, backends / "python" / "triton_python_backend_stub")
    return backends


def build_repository(tmp: Path, models: list[str], batching: bool) -> Path:
    repo = tmp / "repo"
    recsys_bin = ROOT / "target" / "release" / "recsys"
    for model in models:
        engine = ROOT / "model_repository" / model / "1"
        variants = [(model, 100, None)]
        if batching:
            variants += [(f"{model}_q{d}{'_pref' if p else ''}", d, PREFERRED if p else None)
                         for d in DELAYS_US for p in (False, True)]
        for name, delay, preferred in variants:
            (repo / name).mkdir(parents=True)
            (repo / name / "1").symlink_to(engine)
            (repo / name / "config.pbtxt").write_text(recsys_config(name, model, delay, preferred))
        for suffix, _, runtime, precision in PEERS:
            peer = repo / f"{model}{suffix}"
            subprocess.run([str(recsys_bin), "export-onnx", "--engine", str(engine), "--out",
                            str(peer / "1" / "model.onnx"), "--k", "10"], check=True, capture_output=True)
            shutil.copy2(ROOT / "benches" / "triton_peer" / "model.py", peer / "1" / "model.py")
            shutil.copy2(engine / "item_ids.tsv", peer / "item_ids.tsv")
            (peer / "config.pbtxt").write_text(peer_config(f"{model}{suffix}", runtime, precision))
    return repo


def same_answers(server: TritonServer, model: str, suffix: str, users: int = 50) -> float:
    """Share of users for whom recsys and a peer return the same top-10 (the peer is only a peer if
    it computes the same thing)."""
    import numpy as np  # noqa: PLC0415
    import tritonclient.grpc as grpcclient  # noqa: PLC0415

    client = grpcclient.InferenceServerClient(server.grpc_url)
    lines = (ROOT / "tests" / "fixtures" / "test_set.tsv").read_text().splitlines()[1 : users + 1]
    same = 0
    for line in lines:
        history = np.array([[int(x) for x in line.split("\t")[2].split()]], dtype=np.int64)
        answers = []
        for name in (model, f"{model}{suffix}"):
            inp = grpcclient.InferInput("ITEM_IDS", list(history.shape), "INT64")
            inp.set_data_from_numpy(history)
            answers.append(client.infer(name, [inp]).as_numpy("TOP_ITEM_IDS").reshape(-1).tolist())
        same += answers[0] == answers[1]
    client.close()
    return same / len(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert4rec,vaecf")
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--skip-batching", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    models = args.models.split(",")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    # The Python backend's stub embeds libpython, which locates its prefix through the first
    # `python3` on PATH: the venv's, so numpy and onnxruntime import in the peer model.
    site = sysconfig.get_paths()["purelib"]
    os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    # The stub's own runtime libraries ship in the wheel; its RPATH is relative to where pip put it.
    os.environ["LD_LIBRARY_PATH"] = f"{site}/nvidia_pytriton.libs:{os.environ.get('LD_LIBRARY_PATH', '')}"

    peer_rows, batch_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "histories.json"
        input_data(data)
        repo = build_repository(tmp, models, not args.skip_batching)
        with TritonServer(repo, backend_directory(tmp), log_path=tmp / "server.log") as server:
            def measure(model: str, c: int) -> dict:
                return measure_cell(server, model, "grpc", c, data, tmp / f"{model}-{c}.csv")

            agreement = {(m, suffix): same_answers(server, m, suffix) for m in models for suffix, *_ in PEERS}
            for model in models:
                for c in concurrency:
                    ours = measure(model, c)
                    for suffix, label, *_ in PEERS:
                        peer_rows.append((model, c, label, ours, measure(f"{model}{suffix}", c)))
            if not args.skip_batching:
                c = max(concurrency)
                for model in models:
                    for d in DELAYS_US:
                        for pref in (False, True):
                            name = f"{model}_q{d}{'_pref' if pref else ''}"
                            batch_rows.append((model, d, pref, c, measure(name, c)))
    today = datetime.date.today().isoformat()
    labels = {suffix: label for suffix, label, *_ in PEERS}
    out = [
        f"{today}, {platform.node()}: {os.cpu_count()} cores, tritonserver 2.51.0, gRPC, perf_analyzer -p 2000 -s 20 "
        "--max-trials 8, 256 real histories (ragged); recsys fp32 engine vs the same engine exported to ONNX "
        "and run by the Python backend in onnxruntime, in OpenVINO with f32 forced and in OpenVINO at its default "
        "precision; 1 instance, 1 thread, max_queue_delay 100 us for all; identical top-10 on 50 users: "
        + ", ".join(f"{m} vs {labels[s]} {100 * a:.0f} %" for (m, s), a in agreement.items()),
        "",
        "| model | concurrency | peer | recsys infer/s | peer infer/s | throughput ratio | recsys p50 ms | peer p50 ms | "
        "recsys p99 ms | peer p99 ms | p99 ratio (recsys/peer) | recsys compute share | peer compute share | "
        "recsys windows infer/s | peer windows infer/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, c, label, a, b in peer_rows:
        out.append(
            f"| {model} | {c} | {label} | {cell(a, 'throughput', digits=0)} | {cell(b, 'throughput', digits=0)} | "
            f"{ratio(a, b, 'throughput')} | "
            f"{cell(a, 'p50_ms')} | {cell(b, 'p50_ms')} | {cell(a, 'p99_ms')} | {cell(b, 'p99_ms')} | "
            f"{ratio(a, b, 'p99_ms')} | {cell(a, 'compute_share', 100, 0)} % | {cell(b, 'compute_share', 100, 0)} % | "
            f"{spread(a)} | {spread(b)} |")
    out += ["", "windows: each perf_analyzer window's throughput (min-max); UNSTABLE: no 3 windows settled within "
                "30 % (the cell is three windows as they came; its ratios carry a '?'); failed: perf_analyzer could "
                "not measure the cell (the reason follows), and the run went on."]
    if batch_rows:
        out += [
            "",
            f"Dynamic batching (recsys, concurrency {max(concurrency)}; preferred = preferred_batch_size [8, 16]):",
            "",
            "| model | max_queue_delay us | preferred | infer/s | p50 ms | p99 ms | server queue ms | compute ms | compute share |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for model, d, pref, c, r in batch_rows:
            out.append(f"| {model} | {d} | {'yes' if pref else 'no'} | {cell(r, 'throughput', digits=0)} | "
                       f"{cell(r, 'p50_ms')} | {cell(r, 'p99_ms')} | {cell(r, 'queue_ms')} | {cell(r, 'compute_ms')} | "
                       f"{cell(r, 'compute_share', 100, 0)} % |")
    table = "\n".join(out) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
