"""Soak and fault test: the real tritonserver serving both demo models through recsys, under
perf_analyzer at saturation for a fixed time, with invalid requests mixed in, reloads, version
switches and a corrupted version dropped in during the load. Bounded in time; loopback only.

    scripts/soak.sh [--seconds 600] [--concurrency 4] [--out DIR]

Checks (exit 1 when one fails; the summary says which):
  - unexpected errors: every valid request succeeds, every deliberately invalid one gets an error;
    Triton's own success/failure counters agree with what the clients sent;
  - the server never dies;
  - resident memory is flat after warm-up (end vs end-of-warm-up within max(5 %, 16 MiB));
  - reloads and version switches under load lose no request; a corrupted engine in a new version
    directory fails its load and the serving version keeps serving.
Writes DIR/summary.json and DIR/rss.csv (seconds, RSS MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "scripts"))
from triton_harness import TritonServer  # noqa: E402

FIX = ROOT / "tests" / "fixtures"
VERSIONED = "bert4rec_versions"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def counters(metrics_url: str, wait: float = 30.0) -> dict[tuple[str, str], float]:
    # Triton answers ready on HTTP before its metrics endpoint listens, so the first read may find
    # nothing there yet on a slow machine: retry within a bounded wait.
    deadline = time.monotonic() + wait
    while True:
        try:
            text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)
    out = {}
    for m in re.finditer(r'^(nv_inference_request_(?:success|failure))\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        key = (m.group(1), labels.get("model", ""))
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def convert(recsys: Path, kind: str, sub: str, out: Path, *extra: str) -> None:
    subprocess.run([str(recsys), "convert", "--kind", kind, "--checkpoint", str(FIX / sub / "model.safetensors"),
                    "--config", str(FIX / sub / "config.json"), "--item-map", str(FIX / sub / "item_id_map.tsv"),
                    "--out", str(out), "--force", *extra], check=True, capture_output=True, timeout=300)


def perf_analyzer_cmd(server: TritonServer, model: str, concurrency: int, seconds: float, data: Path) -> list[str]:
    # Windows of a quarter of the run; a 1000 % band makes the first three "stable", so perf_analyzer
    # stops by itself after three or four windows, within the run plus a grace period.
    window_ms = max(2000, int(seconds * 1000 / 4))
    return [str(ROOT / ".venv" / "bin" / "perf_analyzer"), "-m", model, "-u", server.grpc_url, "-i", "grpc",
            "--concurrency-range", f"{concurrency}:{concurrency}", "--input-data", str(data),
            "-p", str(window_ms), "-s", "1000", "--max-trials", "3"]


class Mixed(threading.Thread):
    """Valid and invalid requests in turn, each checked: valid ones must answer, invalid ones must fail
    with a message naming the problem."""

    INVALID = [
        ("K = 0", lambda c, m: c.infer(m, [ids([[1]]), k_input(0)])),
        ("K above max_k", lambda c, m: c.infer(m, [ids([[1]]), k_input(100_000)])),
        ("history longer than max_history_length", lambda c, m: c.infer(m, [ids([list(range(20_000))])])),
        ("FP32 item ids", lambda c, m: c.infer(m, [float_ids()])),
        ("unknown input", lambda c, m: c.infer(m, [ids([[1]]), extra_input()])),
    ]

    def __init__(self, url: str, models: list[str], deadline: float):
        super().__init__(daemon=True)
        import tritonclient.http as httpclient  # noqa: PLC0415

        self.client = httpclient.InferenceServerClient(url, network_timeout=60)
        self.models, self.deadline = models, deadline
        self.valid = self.invalid = 0
        self.sent = {m: 0 for m in models}
        self.unexpected: list[str] = []
        self.histories = [[int(x) for x in line.split("\t")[2].split()]
                          for line in (FIX / "test_set.tsv").read_text().splitlines()[1:201]]

    def run(self) -> None:
        i = 0
        while time.monotonic() < self.deadline:
            # Valid and invalid alternate, and each kind goes to every model in turn.
            model = self.models[(i // 2) % len(self.models)]
            if i % 2 == 0:
                try:
                    r = self.client.infer(model, [ids([self.histories[i % len(self.histories)]])])
                    if r.as_numpy("TOP_ITEM_IDS").shape != (1, 10):
                        self.unexpected.append(f"valid request to {model}: shape {r.as_numpy('TOP_ITEM_IDS').shape}")
                except Exception as e:  # noqa: BLE001
                    self.unexpected.append(f"valid request to {model} failed: {e}")
                self.valid += 1
            else:
                name, send = self.INVALID[(i // 2) % len(self.INVALID)]
                try:
                    send(self.client, model)
                    self.unexpected.append(f"invalid request ({name}) to {model} succeeded")
                except Exception as e:  # noqa: BLE001  (the expected outcome)
                    if not str(e).strip():
                        self.unexpected.append(f"invalid request ({name}) failed without a message")
                self.invalid += 1
            self.sent[model] += 1
            i += 1
            time.sleep(0.01)
        # An open keep-alive connection would hold the stopping server for its exit timeout.
        self.client.close()


class SwitchLoad(threading.Thread):
    """Continuous requests (two in flight) to the model whose versions switch; every failure counts."""

    def __init__(self, url: str, deadline: float):
        super().__init__(daemon=True)
        self.url, self.deadline = url, deadline
        self.sent, self.failures, self.versions = 0, [], set()
        self.lock = threading.Lock()

    def run(self) -> None:
        workers = [threading.Thread(target=self.worker, daemon=True) for _ in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def worker(self) -> None:
        import tritonclient.grpc as grpcclient  # noqa: PLC0415

        client = grpcclient.InferenceServerClient(self.url)
        arr = np.array([[10011403, 10011207, 10011739]], dtype=np.int64)
        while time.monotonic() < self.deadline:
            t = grpcclient.InferInput("ITEM_IDS", list(arr.shape), "INT64")
            t.set_data_from_numpy(arr)
            try:
                r = client.infer(VERSIONED, [t])
                version = r.get_response().model_version
                with self.lock:
                    self.versions.add(version)
            except Exception as e:  # noqa: BLE001  (every failure counts)
                with self.lock:
                    self.failures.append(repr(e)[:300])
            with self.lock:
                self.sent += 1
        client.close()


def ids(rows: list[list[int]]):
    import tritonclient.http as httpclient  # noqa: PLC0415

    arr = np.array(rows, dtype=np.int64)
    t = httpclient.InferInput("ITEM_IDS", list(arr.shape), "INT64")
    t.set_data_from_numpy(arr)
    return t


def k_input(k: int):
    import tritonclient.http as httpclient  # noqa: PLC0415

    t = httpclient.InferInput("K", [1, 1], "INT32")
    t.set_data_from_numpy(np.array([[k]], dtype=np.int32))
    return t


def float_ids():
    import tritonclient.http as httpclient  # noqa: PLC0415

    t = httpclient.InferInput("ITEM_IDS", [1, 2], "FP32")
    t.set_data_from_numpy(np.array([[1.0, 2.0]], dtype=np.float32))
    return t


def extra_input():
    import tritonclient.http as httpclient  # noqa: PLC0415

    t = httpclient.InferInput("NOT_AN_INPUT", [1, 1], "INT64")
    t.set_data_from_numpy(np.array([[1]], dtype=np.int64))
    return t


def serving_version(url: str, model: str) -> str:
    import tritonclient.http as httpclient  # noqa: PLC0415

    with httpclient.InferenceServerClient(url) as client:
        return client.infer(model, [ids([[10011403, 10011207]])]).get_response()["model_version"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--warmup", type=float, help="seconds before the RSS baseline (default: 20 %% of the run)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "soak")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        return soak(args)
    except Exception:  # noqa: BLE001  (a crash is a failed soak, and the summary says where it happened)
        crash = traceback.format_exc()
        print(crash, file=sys.stderr)
        (args.out / "summary.json").write_text(json.dumps(
            {"seconds": args.seconds, "ok": False, "problems": [f"soak.py crashed:\n{crash}"]}, indent=2) + "\n")
        return 1


def soak(args: argparse.Namespace) -> int:
    recsys = ROOT / "target" / "release" / "recsys"
    backend = Path(os.environ.get("RECSYS_BACKEND_DIR", ROOT / "build" / "backends"))
    warmup = args.warmup if args.warmup is not None else 0.2 * args.seconds
    events: list[str] = []
    problems: list[str] = []

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        repo = tmp / "repo"
        for model, kind, sub in [("bert4rec", "bert4rec", "bert4rec"), ("vaecf", "vaecf", "multivae")]:
            (repo / model).mkdir(parents=True)
            shutil.copy(ROOT / "model_repository" / model / "config.pbtxt", repo / model / "config.pbtxt")
            convert(recsys, kind, sub, tmp / f"{model}-fp32")
        convert(recsys, "bert4rec", "bert4rec", tmp / "bert4rec-int8", "--precision", "int8")
        # The version switches happen on their own model: perf_analyzer pins the version it found at
        # start for its server-side statistics and stops when that version goes away, so it drives the
        # two fixed models while a client thread drives this one.
        (repo / VERSIONED).mkdir()
        (repo / VERSIONED / "config.pbtxt").write_text(
            (ROOT / "model_repository" / "bert4rec" / "config.pbtxt").read_text()
            .replace('name: "bert4rec"', f'name: "{VERSIONED}"'))

        def registry(*cli: str, model: str = VERSIONED) -> str:
            return subprocess.run([str(recsys), *cli, "--repository", str(repo), "--model", model],
                                  check=True, capture_output=True, text=True, timeout=180).stdout

        registry("publish", "--approve", "--engine", str(tmp / "bert4rec-fp32"))
        registry("publish", "--approve", "--engine", str(tmp / "bert4rec-fp32"), model="bert4rec")
        registry("publish", "--approve", "--engine", str(tmp / "vaecf-fp32"), model="vaecf")
        data = tmp / "histories.json"
        from bench_serving import input_data  # noqa: PLC0415

        input_data(data)
        with TritonServer(repo, backend, explicit=True, load_models=["bert4rec", "vaecf", VERSIONED],
                          log_path=args.out / "server.log") as server:
            pid = server.process.pid
            url = f"http://{server.http_url}"
            start = time.monotonic()
            deadline = start + args.seconds
            before = counters(server.metrics_url)
            env = dict(os.environ)
            cudart = next((ROOT / ".venv" / "lib").glob("python3*/site-packages/nvidia/cuda_runtime/lib"), None)
            if cudart:
                env["LD_LIBRARY_PATH"] = f"{cudart}:{env.get('LD_LIBRARY_PATH', '')}"
            loads = {m: subprocess.Popen(perf_analyzer_cmd(server, m, args.concurrency, args.seconds, data),
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                     for m in ["bert4rec", "vaecf"]}
            mixed = Mixed(server.http_url, ["bert4rec", "vaecf"], deadline)
            mixed.start()
            switching = SwitchLoad(server.grpc_url, deadline)
            switching.start()
            rss: list[tuple[float, float]] = []
            steps = [
                (0.30, "reload vaecf (same version) under load"),
                (0.40, f"publish v2 (int8) and approve: {VERSIONED} switches to v2"),
                (0.55, "drop a corrupted engine in as v3 and ask Triton to serve it"),
                (0.70, f"reject v2: {VERSIONED} rolls back to v1"),
                (0.85, "reload bert4rec (same version) under load"),
            ]
            while time.monotonic() < deadline + 30 and any(p.poll() is None for p in loads.values()):
                now = time.monotonic() - start
                if server.process.poll() is not None:
                    problems.append(f"tritonserver died at {now:.0f} s (exit {server.process.returncode})")
                    break
                rss.append((now, rss_mib(pid)))
                while steps and now >= steps[0][0] * args.seconds:
                    _, what = steps.pop(0)
                    events.append(f"{now:.0f} s: {what}")
                    try:
                        if what.startswith("reload"):
                            import tritonclient.http as httpclient  # noqa: PLC0415

                            with httpclient.InferenceServerClient(server.http_url, network_timeout=120) as client:
                                client.load_model(what.split()[1])
                        elif what.startswith("publish v2"):
                            registry("publish", "--approve", "--engine", str(tmp / "bert4rec-int8"), "--server", url,
                                     "--canary-on-traffic")
                            v = serving_version(server.http_url, VERSIONED)
                            events.append(f"  serving {VERSIONED} v{v}")
                            if v != "2":
                                problems.append(f"after approving v2, v{v} serves")
                        elif what.startswith("drop a corrupted"):
                            bad = repo / VERSIONED / "3"
                            shutil.copytree(repo / VERSIONED / "2", bad)
                            weights = bytearray((bad / "weights.safetensors").read_bytes())
                            weights[len(weights) // 2] ^= 0xFF
                            (bad / "weights.safetensors").write_bytes(bytes(weights))
                            config = (repo / VERSIONED / "config.pbtxt").read_text()
                            (repo / VERSIONED / "config.pbtxt").write_text(
                                re.sub(r"versions: \[ *\d+ *\]", "versions: [ 3 ]", config))
                            import tritonclient.http as httpclient  # noqa: PLC0415

                            try:
                                with httpclient.InferenceServerClient(server.http_url) as client:
                                    client.load_model(VERSIONED)
                                problems.append("a corrupted engine loaded")
                            except Exception as e:  # noqa: BLE001
                                events.append(f"  load refused: {str(e).splitlines()[0][:200]}")
                            (repo / VERSIONED / "config.pbtxt").write_text(config)
                            shutil.rmtree(bad)
                            v = serving_version(server.http_url, VERSIONED)
                            events.append(f"  still serving {VERSIONED} v{v}")
                            if v != "2":
                                problems.append(f"after the corrupted v3, v{v} serves instead of v2")
                        elif what.startswith("reject v2"):
                            registry("reject", "--version", "2", "--server", url)
                            v = serving_version(server.http_url, VERSIONED)
                            events.append(f"  serving {VERSIONED} v{v}")
                            if v != "1":
                                problems.append(f"after rejecting v2, v{v} serves")
                    except Exception as e:  # noqa: BLE001
                        problems.append(f"{what}: {e}")
                time.sleep(2.0)
            mixed.join(timeout=60)
            switching.join(timeout=60)
            outputs = {}
            for m, p in loads.items():
                try:
                    outputs[m] = p.communicate(timeout=0.5 * args.seconds + 60)[0]
                except subprocess.TimeoutExpired:
                    p.kill()
                    outputs[m] = p.communicate()[0]
                    problems.append(f"perf_analyzer on {m} did not stop by itself")
                if p.returncode != 0:
                    problems.append(f"perf_analyzer on {m} exited {p.returncode}: {outputs[m][-1500:]}")
            after = counters(server.metrics_url)
            alive = server.process.poll() is None

    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}
    success = {m: delta.get(("nv_inference_request_success", m), 0.0) for m in ["bert4rec", "vaecf"]}
    failure = {m: delta.get(("nv_inference_request_failure", m), 0.0) for m in ["bert4rec", "vaecf"]}
    if not alive:
        problems.append("tritonserver was not alive at the end")
    problems += mixed.unexpected[:20]
    if switching.failures:
        problems.append(f"{len(switching.failures)} of {switching.sent} requests to {VERSIONED} failed during "
                        f"version switches, first: {switching.failures[0]}")
    if mixed.unexpected:
        problems.append(f"{len(mixed.unexpected)} unexpected outcomes in the mixed traffic")
    # Triton counts a request as failed when the backend answers with an error: exactly the invalid ones
    # that reach the backend (an unknown input or a wrong dtype is refused by Triton before it counts).
    failed_total = sum(failure.values())
    if failed_total > mixed.invalid:
        problems.append(f"Triton counted {failed_total:.0f} failed requests, only {mixed.invalid} invalid ones were sent")
    base = [r for t, r in rss if t >= warmup]
    rss_start, rss_end = (base[0], base[-1]) if base else (float("nan"), float("nan"))
    growth = rss_end - rss_start
    if not base or growth > max(0.05 * rss_start, 16.0):
        problems.append(f"resident memory grew {growth:.1f} MiB after warm-up ({rss_start:.1f} -> {rss_end:.1f} MiB)")
    throughput = {}
    for m, text in outputs.items():
        found = re.findall(r"Throughput: ([0-9.]+) infer/sec", text)
        throughput[m] = float(found[-1]) if found else None
    summary = {
        "seconds": args.seconds,
        "concurrency_per_model": args.concurrency,
        "requests_succeeded": success,
        "requests_failed": failure,
        "mixed_valid_sent": mixed.valid,
        "versioned_model_requests": switching.sent,
        "versioned_model_failures": len(switching.failures),
        "versions_seen": sorted(switching.versions),
        "mixed_invalid_sent": mixed.invalid,
        "perf_analyzer_throughput": throughput,
        "rss_mib": {"first": rss[0][1] if rss else None, "after_warmup": rss_start, "end": rss_end,
                    "max": max((r for _, r in rss), default=None), "growth_after_warmup": growth},
        "events": events,
        "problems": problems,
        "ok": not problems,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "rss.csv").write_text("seconds,rss_mib\n" + "".join(f"{t:.1f},{r:.2f}\n" for t, r in rss))
    print(json.dumps(summary, indent=2))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
