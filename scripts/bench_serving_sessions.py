"""Growing sessions through tritonserver: the real perf_analyzer replays interleaved sessions (each
request is one user's whole history, one event longer than that user's previous request) against
GRU4Rec, SASRec and HSTU (`--models hstu`: the official large ML-1M config, events an hour apart,
each request at its user's next event's time) at MovieLens-1M's shapes served by the recsys backend
with its prefix cache (the default) and without it (the same engine, `prefix_cache_bytes` 0); the table gives throughput,
p50/p99 latency, and from the server's Prometheus counters the cache's hit rate and the events it
computed per request. Bounded: every perf_analyzer run has a time limit, the server is always
stopped.

    scripts/bench.sh serving-sessions [--models gru4rec,sasrec] [--users 64] [--events 200]
                                      [--concurrency 1,8] [--threads 2] [--out FILE.md]

Requests: `users` histories of at least `events` distinct items (MovieLens-1M's length
distribution), sent as user 1's first event, user 2's first, ..., user 1's second, ...: every user
comes back after all the others, as concurrent sessions do; when perf_analyzer has sent them all it
starts again from the first event (sessions restart), so the mix covers every length from 1 to
`events` evenly.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from bench_models import RECSYS, ml1m_histories  # noqa: E402
from bench_peers import peer_config  # noqa: E402
from bench_sequential import ml1m_model  # noqa: E402
from bench_serving import cell, measure, spread  # noqa: E402
from cpu_info import cpu_model  # noqa: E402
from triton_harness import TritonServer  # noqa: E402

COUNTERS = ["hits_total", "misses_total", "events_computed_total", "events_reused_total"]


# HSTU's time inputs: a timestamp per history id (ragged like it) and the query time.
TIME_INPUTS = """,
  { name: "ITEM_TIMESTAMPS" data_type: TYPE_INT64 dims: [ -1 ] allow_ragged_batch: true },
  { name: "QUERY_TIMESTAMP" data_type: TYPE_INT64 dims: [ 1 ] optional: true }
]
output ["""
# The first event's time of every session; events are an hour apart, each request asked at the
# time of its user's next event.
T0 = 1_600_000_000


def config(name: str, threads: int, cache: bool, timed: bool = False) -> str:
    """The recsys model's config (the serving benchmarks' inputs, outputs and batching, with
    HSTU's time inputs when `timed`), with the prefix cache left at its default or turned off."""
    text = (peer_config(name, runtime=None)
            .replace('backend: "python"', 'backend: "recsys"')
            .replace('string_value: "1"', f'string_value: "{threads}"'))
    if timed:
        text = text.replace("\n]\noutput [", TIME_INPUTS, 1)
    threads_parameter = f'{{ key: "threads" value {{ string_value: "{threads}" }} }}'
    assert threads_parameter in text, text
    if not cache:
        text = text.replace(threads_parameter,
                            threads_parameter + ', { key: "prefix_cache_bytes" value { string_value: "0" } }')
    return text


def counters(server: TritonServer, model: str) -> dict[str, float]:
    """The model's prefix cache counters (all 0 when it has no cache)."""
    out = {c: 0.0 for c in COUNTERS}
    with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            for c in COUNTERS:
                if line.startswith(f"recsys_prefix_cache_{c}{{") and f'model="{model}"' in line:
                    out[c] = float(line.rsplit(" ", 1)[1])
    return out


def session_data(path: Path, histories: list[list[int]], events: int, timed: bool = False) -> int:
    def request(h: list[int], t: int) -> dict:
        out = {"ITEM_IDS": {"content": h[:t], "shape": [t]}}
        if timed:
            out["ITEM_TIMESTAMPS"] = {"content": [T0 + 3600 * p for p in range(t)], "shape": [t]}
            out["QUERY_TIMESTAMP"] = {"content": [T0 + 3600 * t], "shape": [1]}
        return out

    data = [request(h, t) for t in range(1, events + 1) for h in histories]
    path.write_text(json.dumps({"data": data}))
    return len(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gru4rec,sasrec")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--threads", type=int, default=2, help="the backend's threads per model instance")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    backend = ROOT / "build" / "backends"
    if not (backend / "recsys" / "libtriton_recsys.so").exists():
        sys.exit("build/backends/recsys/libtriton_recsys.so is missing: run scripts/bench.sh serving-sessions")
    kinds = args.models.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rng = np.random.default_rng(45)
        repo = tmp / "repo"
        data: dict[str, tuple[Path, int]] = {}
        for kind in kinds:
            ckpt, cfg_path, map_path = ml1m_model(kind, tmp, rng)
            engine = tmp / "engines" / kind
            subprocess.run([str(RECSYS), "convert", "--kind", kind, "--checkpoint", str(ckpt), "--config",
                            str(cfg_path), "--item-map", str(map_path), "--out", str(engine)],
                           check=True, capture_output=True)
            ext = sorted(int(line.split("\t")[1]) for line in map_path.read_text().splitlines()[1:])
            histories = [h for h in ml1m_histories(ext, rng, count=4000) if len(h) >= args.events][: args.users]
            if len(histories) < args.users:
                sys.exit(f"only {len(histories)} histories of {args.events} events; ask for fewer --users or --events")
            path = tmp / f"{kind}-sessions.json"
            timed = kind == "hstu"
            data[kind] = (path, session_data(path, histories, args.events, timed))
            for name, cache in [(kind, True), (f"{kind}_nocache", False)]:
                (repo / name).mkdir(parents=True)
                (repo / name / "1").symlink_to(engine)
                (repo / name / "config.pbtxt").write_text(config(name, args.threads, cache, timed))
        with TritonServer(repo, backend, log_path=tmp / "server.log") as server:
            for kind in kinds:
                path, requests = data[kind]
                for c in levels:
                    for name in (kind, f"{kind}_nocache"):
                        before = counters(server, name)
                        result = measure(server, name, "grpc", c, path, tmp / f"{name}-{c}.csv")
                        after = counters(server, name)
                        delta = {k: after[k] - before[k] for k in COUNTERS}
                        rows.append((kind, name.endswith("_nocache"), c, result, delta, requests))
    lines = [
        f"{datetime.date.today().isoformat()}, CPU (lscpu): {cpu_model()}; tritonserver 2.51.0 + recsys backend, "
        f"{args.threads} threads per instance, dynamic batching (100 us); perf_analyzer over gRPC, 2 s windows; "
        f"{args.users} interleaved sessions of {args.events} events at MovieLens-1M's shapes (random weights)",
        "",
        "| model | prefix cache | concurrency | infer/s | windows infer/s | p50 ms | p99 ms | hit rate | "
        "events computed / request | p50 off / on |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(k, off, c): r for k, off, c, r, _, _ in rows}
    for kind, off, c, result, delta, _ in rows:
        answered = delta["hits_total"] + delta["misses_total"]
        hit_rate = f"{100 * delta['hits_total'] / answered:.1f} %" if answered else "-"
        computed = f"{delta['events_computed_total'] / answered:.2f}" if answered else "all"
        on = by_key.get((kind, False, c), {})
        ratio = "-"
        if off and "p50_ms" in result and "p50_ms" in on:
            ratio = f"{result['p50_ms'] / on['p50_ms']:.2f}" + ("?" if result.get("unstable") or on.get("unstable") else "")
        lines.append(f"| {kind} | {'off' if off else 'on'} | {c} | {cell(result, 'throughput', digits=0)} | "
                     f"{spread(result)} | {cell(result, 'p50_ms')} | {cell(result, 'p99_ms')} | {hit_rate} | "
                     f"{computed} | {ratio} |")
    lines += ["", "hit rate and events computed come from the server's recsys_prefix_cache_* counters over the "
                  "model's perf_analyzer run (its warm-up included); an uncached model computes every event of "
                  "every request (its average history is about half of the session length)."]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
