"""tritonserver with the recsys backend serving each model family twice, a KIND_GPU instance and a
KIND_CPU instance of the same converted engine, in one server: the GPU model must answer every
request as the CPU model does (the same items except where two CPU scores are within the tolerance
of each other, every score within SCORE_ABS_TOL), and a bounded load at concurrency 1 and 16 gives
each its throughput and p50/p99 latency.

The client speaks Triton's HTTP/REST protocol (KServe v2, JSON) with the standard library, one
process per concurrent client so the client's interpreter is never the bottleneck: tritonclient's
wheels and perf_analyzer do not fit the device call beside the server. Writes to RESULTS:
summary.md, serving.json and server.log.

    python3 serving_check.py --server BIN --server-libraries DIR --backends DIR --fixtures DIR \
        --results DIR [--cpu-only] [--seconds S]

The recsys Python package (for the conversion) must be importable.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# As the Python package's device check: different summation orders, and the GPU fuses multiply-adds.
SCORE_ABS_TOL = 2e-4
K = 10
USERS = 200
CONCURRENCY = (1, 16)
# (the name the server gives the model, the converter's kind, the fixture's folder)
MODELS = [("bert4rec", "bert4rec", "bert4rec"), ("vaecf", "vaecf", "multivae"),
          ("sasrec", "sasrec", "sasrec"), ("gru4rec", "gru4rec", "gru4rec")]

CONFIG = """name: "{name}"
backend: "recsys"
max_batch_size: 64
input [
  {{ name: "ITEM_IDS" data_type: TYPE_INT64 dims: [ -1 ] allow_ragged_batch: true }},
  {{ name: "K" data_type: TYPE_INT32 dims: [ 1 ] optional: true }}
]
output [
  {{ name: "TOP_ITEM_IDS" data_type: TYPE_INT64 dims: [ -1 ] }},
  {{ name: "TOP_SCORES" data_type: TYPE_FP32 dims: [ -1 ] }}
]
dynamic_batching {{ max_queue_delay_microseconds: 100 }}
instance_group [ {{ kind: {kind} count: 1{gpus} }} ]
parameters [ {{ key: "top_k" value {{ string_value: "{k}" }} }} ]
"""


def histories(fixtures: Path) -> list[list[int]]:
    rows = (fixtures / "test_set.tsv").read_text().splitlines()[1:USERS + 1]
    return [[int(x) for x in row.split("\t")[2].split()] for row in rows]


def build_repository(fixtures: Path, repo: Path, kinds: list[str]) -> None:
    import recsys  # the kernel bundle's package: converts exactly as `recsys convert` does

    for name, kind, folder in MODELS:
        src = fixtures / folder
        engine = repo / "engines" / name
        recsys.convert(kind, src / "model.safetensors", src / "item_id_map.tsv", engine,
                       config=src / "config.json")
        for instance in kinds:
            model = repo / "models" / f"{name}_{instance.lower()}"
            shutil.copytree(engine, model / "1", copy_function=os.link)
            gpus = " gpus: [ 0 ]" if instance == "GPU" else ""
            (model / "config.pbtxt").write_text(
                CONFIG.format(name=model.name, kind=f"KIND_{instance}", gpus=gpus, k=K))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def infer_body(history: list[int]) -> bytes:
    return json.dumps({"inputs": [
        {"name": "ITEM_IDS", "datatype": "INT64", "shape": [1, len(history)], "data": history},
        {"name": "K", "datatype": "INT32", "shape": [1, 1], "data": [K]},
    ]}).encode()


def infer(conn: http.client.HTTPConnection, model: str, body: bytes) -> tuple[list[int], list[float]]:
    conn.request("POST", f"/v2/models/{model}/infer", body, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    data = reply.read()
    if reply.status != 200:
        raise RuntimeError(f"{model}: HTTP {reply.status}: {data[:300]!r}")
    outputs = {o["name"]: o["data"] for o in json.loads(data)["outputs"]}
    return outputs["TOP_ITEM_IDS"], outputs["TOP_SCORES"]


def parity(port: int, name: str, users: list[list[int]]) -> dict:
    """The GPU model's answers against the CPU model's, user by user."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    worst, swapped, ranks = 0.0, 0, 0
    for history in users:
        body = infer_body(history)
        want_ids, want_scores = infer(conn, f"{name}_cpu", body)
        got_ids, got_scores = infer(conn, f"{name}_gpu", body)
        if len(got_ids) != len(want_ids):
            swapped += abs(len(got_ids) - len(want_ids))
        for pos, (w, g) in enumerate(zip(want_ids, got_ids)):
            ranks += 1
            worst = max(worst, abs(want_scores[pos] - got_scores[pos]))
            if w != g:
                # A swap is allowed only between items whose CPU scores are within the tolerance.
                near = {i for i, s in zip(want_ids, want_scores)
                        if abs(s - want_scores[pos]) <= 2 * SCORE_ABS_TOL}
                swapped += g not in near
    conn.close()
    return {"ranks": ranks, "out_of_place": swapped, "max_score_diff": worst,
            "ok": swapped == 0 and worst <= SCORE_ABS_TOL}


def client(port: int, model: str, bodies: list[bytes], seconds: float, start: float, out) -> None:
    """One concurrent client: requests back to back from `start` for `seconds`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    latencies, errors, i = [], 0, os.getpid()
    while time.time() < start:
        time.sleep(0.001)
    end = start + seconds
    while time.time() < end:
        body = bodies[i % len(bodies)]
        i += 1
        t0 = time.perf_counter()
        try:
            infer(conn, model, body)
            latencies.append(time.perf_counter() - t0)
        except (OSError, RuntimeError, http.client.HTTPException):
            errors += 1
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    out.put((latencies, errors))


def load(port: int, model: str, users: list[list[int]], concurrency: int, seconds: float) -> dict:
    bodies = [infer_body(h) for h in users]
    queue = multiprocessing.Queue()
    start = time.time() + 0.5
    workers = [multiprocessing.Process(target=client, args=(port, model, bodies, seconds, start, queue))
               for _ in range(concurrency)]
    for w in workers:
        w.start()
    latencies, errors = [], 0
    for _ in workers:
        got, failed = queue.get(timeout=seconds + 120)
        latencies += got
        errors += failed
    for w in workers:
        w.join(timeout=30)
    latencies.sort()
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [float("nan")] * 99
    return {"model": model, "concurrency": concurrency, "requests": len(latencies), "errors": errors,
            "per_second": len(latencies) / seconds, "p50_ms": 1e3 * q[49], "p99_ms": 1e3 * q[98]}


class Server:
    """tritonserver on 127.0.0.1 in its own process group, stopped (TERM, then KILL) on exit."""

    def __init__(self, binary: Path, libraries: Path, backends: Path, repo: Path, log: Path):
        self.port = free_port()
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = f"{libraries}:{env.get('LD_LIBRARY_PATH', '')}"
        self.log = open(log, "w")
        self.process = subprocess.Popen(
            [str(binary), f"--model-repository={repo}", f"--backend-directory={backends}",
             "--model-control-mode=explicit", "--load-model=*", "--exit-on-error=false",
             "--strict-readiness=true", "--http-address=127.0.0.1", f"--http-port={self.port}",
             "--allow-grpc=false", "--allow-metrics=false", "--pinned-memory-pool-byte-size=0"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_loaded(self, seconds: float) -> dict[str, str]:
        """Waits for the server to answer (it loads every model before it does) and returns each
        model's state from the repository index: "READY", or the state and Triton's reason."""
        deadline = time.time() + seconds
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}: see server.log")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/v2/health/live")
                live = conn.getresponse()
                live.read()
                if live.status == 200:
                    conn.request("POST", "/v2/repository/index", b"{}", {"Content-Type": "application/json"})
                    index = json.loads(conn.getresponse().read())
                    conn.close()
                    return {m["name"]: m.get("state", "?") if m.get("state") == "READY"
                            else f"{m.get('state', '?')}: {m.get('reason', '')}" for m in index}
                conn.close()
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"tritonserver did not answer within {seconds:.0f} s: see server.log")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def summary(report: dict) -> str:
    served = "a KIND_CPU model" if report["cpu_only"] else "a KIND_GPU and a KIND_CPU model"
    lines = [f"tritonserver ({report['server']}), the recsys backend built for CUDA "
             f"{report['cuda']}; {report['device']}. Each family converted once and served as "
             f"{served} (one instance each, dynamic batching up to 64, 100 us queue delay) in the "
             f"same server; k = {K}; the fixtures' first {USERS} test users.", ""]
    if report["parity"]:
        lines += ["| model | ranks compared | out of place beyond near-ties | max score diff | verdict |",
                  "|---|---|---|---|---|"]
        for name, p in report["parity"].items():
            lines.append(f"| {name} | {p['ranks']} | {p['out_of_place']} | {p['max_score_diff']:.2e} | "
                         f"{'ok' if p['ok'] else 'FAIL'} |")
        lines.append("")
    lines += [f"Bounded load: {report['seconds']:.0f} s per cell, each client one HTTP connection "
              "sending requests back to back (one process per client).", "",
              "| model | instance | concurrency | requests/s | p50 ms | p99 ms | errors |",
              "|---|---|---|---|---|---|---|"]
    for cell in report["load"]:
        name, instance = cell["model"].rsplit("_", 1)
        lines.append(f"| {name} | KIND_{instance.upper()} | {cell['concurrency']} | {cell['per_second']:.0f} | "
                     f"{cell['p50_ms']:.3f} | {cell['p99_ms']:.3f} | {cell['errors']} |")
    by = {(c["model"], c["concurrency"]): c for c in report["load"]}
    ratios = []
    for name, _, _ in MODELS:
        for c in CONCURRENCY:
            gpu, cpu = by.get((f"{name}_gpu", c)), by.get((f"{name}_cpu", c))
            if gpu and cpu and cpu["per_second"] > 0:
                ratios.append(f"{name} at {c}: {gpu['per_second'] / cpu['per_second']:.2f}x")
    if ratios:
        lines += ["", "GPU throughput over CPU throughput: " + "; ".join(ratios) + "."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", type=Path, required=True)
    parser.add_argument("--server-libraries", type=Path, required=True)
    parser.add_argument("--backends", type=Path, required=True)
    parser.add_argument("--fixtures", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--cpu-only", action="store_true", help="KIND_CPU models only (no GPU here)")
    parser.add_argument("--seconds", type=float, default=5.0, help="load per cell")
    parser.add_argument("--cuda", default="?")
    parser.add_argument("--device", default="?")
    args = parser.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    kinds = ["CPU"] if args.cpu_only else ["GPU", "CPU"]
    users = histories(args.fixtures)
    report = {"server": "nvidia-pytriton's tritonserver", "cuda": args.cuda, "device": args.device,
              "cpu_only": args.cpu_only, "seconds": args.seconds, "parity": {}, "load": [],
              "errors": []}
    with tempfile.TemporaryDirectory() as work:
        repo = Path(work)
        t0 = time.perf_counter()
        build_repository(args.fixtures, repo, kinds)
        print(f"converted {len(MODELS)} models in {time.perf_counter() - t0:.1f} s", flush=True)
        models = [f"{name}_{k.lower()}" for name, _, _ in MODELS for k in kinds]
        server = Server(args.server, args.server_libraries, args.backends, repo / "models",
                        args.results / "server.log")
        try:
            t0 = time.perf_counter()
            states = server.wait_loaded(300)
            print(f"tritonserver answered after {time.perf_counter() - t0:.1f} s: {states}", flush=True)
            ready = {m for m in models if states.get(m) == "READY"}
            for m in models:
                if m not in ready:
                    report["errors"].append(f"{m} did not load: {states.get(m, 'not in the index')}")
            if not args.cpu_only:
                for name, _, _ in MODELS:
                    if {f"{name}_gpu", f"{name}_cpu"} <= ready:
                        report["parity"][name] = parity(server.port, name, users)
                        print(f"parity {name}: {report['parity'][name]}", flush=True)
            for name, _, _ in MODELS:
                for k in kinds:
                    model = f"{name}_{k.lower()}"
                    for c in CONCURRENCY:
                        if model in ready:
                            cell = load(server.port, model, users, c, args.seconds)
                            report["load"].append(cell)
                            print(f"load {cell}", flush=True)
        except (RuntimeError, OSError) as e:
            report["errors"].append(str(e))
            print(f"error: {e}", file=sys.stderr)
        finally:
            server.stop()
    (args.results / "serving.json").write_text(json.dumps(report, indent=1))
    text = summary(report)
    if report["errors"]:
        text += "\n\nErrors: " + "; ".join(report["errors"])
    (args.results / "summary.md").write_text(text + "\n")
    print(text)
    failed = report["errors"] or any(not p["ok"] for p in report["parity"].values()) \
        or any(c["errors"] or not c["requests"] for c in report["load"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
