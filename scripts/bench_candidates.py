"""Candidate re-ranking against whole-catalogue top-k at catalogue scale, and against ONNX Runtime
scoring the same candidates, in one invocation with equal threads.

    scripts/bench.sh candidates [--items 1000000] [--threads 2] [--out FILE.md]

The model is BERT4Rec with the fixture's trained encoder (d = 64, 2 layers, 2 heads, max_len 50)
and a random item table of --items rows (a trained table of that size is not available here; the
cost does not depend on the values). Each request is one user (batch 1), k = 10, the history left
out; candidates are random distinct items. Measured, p50 per request:

- engine: `model_probe` (the engine in-process: encoder + fused score + top-k over the whole table,
  or over the request's candidates only);
- backend: the real tritonserver with the recsys backend (1 instance, --threads scoring threads),
  one request at a time from the real tritonclient over gRPC (client-seen latency, candidates on the
  wire included);
- ONNX Runtime: the graphs `recsys export-onnx` writes for the same engine (`--k 10`, and
  `--candidates --k 10`: Gather + MatMul + TopK), session.run alone, intra-op threads = --threads.

Bounded: fixed request counts, the server always stopped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_catalogue import FIRST_ID  # noqa: E402
from bench_catalogue import checkpoints as synthetic_checkpoint  # noqa: E402
from triton_harness import TritonServer  # noqa: E402

RECSYS = ROOT / "target" / "release" / "recsys"
PROBE = ROOT / "target" / "release" / "model_probe"
K = 10
USERS = 64
CANDIDATE_COUNTS = [100, 1_000, 10_000]


def synthetic_engine(items: int, tmp: Path) -> Path:
    """The fixture BERT4Rec's encoder with a random item table of `items` rows, converted."""
    ckpt, cfg, item_map = synthetic_checkpoint("bert4rec", items, tmp)
    engine = tmp / "engine"
    subprocess.run([str(RECSYS), "convert", "--kind", "bert4rec", "--checkpoint", str(ckpt), "--config", str(cfg),
                    "--item-map", str(item_map), "--out", str(engine)], check=True, capture_output=True, timeout=900)
    return engine


def probe(engine: Path, histories: list, candidates: list | None, threads: int, reps: int, tmp: Path) -> float:
    hist_path = tmp / "histories.json"
    hist_path.write_text(json.dumps(histories))
    cmd = [str(PROBE), str(engine), str(hist_path), "1", str(K), str(threads), str(reps)]
    if candidates is not None:
        cand_path = tmp / "candidates.json"
        cand_path.write_text(json.dumps(candidates))
        cmd.append(str(cand_path))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    return json.loads(out.stdout)["median_s"]


def ort_session(path: Path, threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def ort_feeds(histories: list, candidates: list | None, max_len: int, items: int) -> list[dict]:
    feeds = []
    for u, h in enumerate(histories):
        idx = [x - FIRST_ID for x in h]
        seq = np.zeros((1, max_len), dtype=np.int64)
        tail = idx[-(max_len - 1):]
        seq[0, : len(tail)] = tail
        seq[0, len(tail)] = items + 1
        feed = {"item_seq": seq, "exclude_ids": np.array([idx], dtype=np.int64)}
        if candidates is not None:
            feed["candidate_ids"] = np.array([[x - FIRST_ID for x in candidates[u]]], dtype=np.int64)
        feeds.append(feed)
    return feeds


def time_ort(sess: ort.InferenceSession, feeds: list[dict], reps: int) -> tuple[float, list]:
    first = sess.run(None, feeds[0])
    times = []
    for r in range(reps):
        start = time.perf_counter()
        sess.run(None, feeds[r % len(feeds)])
        times.append(time.perf_counter() - start)
    return float(np.median(times)), first[1][0].tolist()


def compute_ns(client) -> tuple[int, int]:
    """Triton's cumulative compute time of the model (the backend's Execute, as it reports it)."""
    stats = client.get_inference_statistics("b4r", as_json=True)["model_stats"][0]["inference_stats"]
    return int(stats["compute_infer"]["ns"]), int(stats["compute_infer"]["count"])


def time_backend(client, module, histories: list, candidates: list | None, reps: int) -> tuple[float, float, list]:
    """Client-seen p50 and the backend's mean compute per request (Triton's statistics)."""
    def request(u):
        h = np.array([histories[u]], dtype=np.int64)
        inputs = [module.InferInput("ITEM_IDS", list(h.shape), "INT64")]
        inputs[0].set_data_from_numpy(h)
        k = module.InferInput("K", [1, 1], "INT32")
        k.set_data_from_numpy(np.array([[K]], dtype=np.int32))
        inputs.append(k)
        if candidates is not None:
            c = np.array([candidates[u]], dtype=np.int64)
            inputs.append(module.InferInput("CANDIDATE_ITEM_IDS", list(c.shape), "INT64"))
            inputs[-1].set_data_from_numpy(c)
        return inputs

    outputs = [module.InferRequestedOutput("TOP_ITEM_IDS"), module.InferRequestedOutput("TOP_SCORES")]
    first = client.infer("b4r", request(0), outputs=outputs).as_numpy("TOP_ITEM_IDS")[0].tolist()
    times = []
    ns0, count0 = compute_ns(client)
    for r in range(reps):
        inputs = request(r % len(histories))
        start = time.perf_counter()
        client.infer("b4r", inputs, outputs=outputs)
        times.append(time.perf_counter() - start)
    ns1, count1 = compute_ns(client)
    return float(np.median(times)), (ns1 - ns0) / max(count1 - count0, 1) * 1e-9, first


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=200, help="requests per candidate case (whole catalogue: a quarter)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import tritonclient.grpc as grpcclient

    rng = np.random.default_rng(9)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        print(f"converting a BERT4Rec with {args.items:,} items ...", file=sys.stderr)
        engine = synthetic_engine(args.items, tmp)
        max_len = json.loads((engine / "manifest.json").read_text())["model"]["max_len"]
        histories = [[FIRST_ID + int(x) for x in rng.choice(np.arange(1, args.items + 1), size=int(rng.integers(5, 49)),
                                                           replace=False)] for _ in range(USERS)]
        cases: list[tuple[str, list | None]] = [("whole catalogue", None)]
        for c in CANDIDATE_COUNTS:
            cases.append((f"{c:,} candidates", [[FIRST_ID + int(x) for x in rng.choice(np.arange(1, args.items + 1),
                                                                                       size=c, replace=False)]
                                                for _ in range(USERS)]))
        onnx_whole, onnx_cand = tmp / "whole.onnx", tmp / "candidates.onnx"
        for path, extra in [(onnx_whole, []), (onnx_cand, ["--candidates"])]:
            subprocess.run([str(RECSYS), "export-onnx", "--engine", str(engine), "--out", str(path), "--k", str(K),
                            *extra], check=True, capture_output=True, timeout=900)

        results = {}
        for label, cand in cases:
            reps = args.reps // 4 if cand is None else args.reps
            print(f"engine and ONNX Runtime: {label} ...", file=sys.stderr)
            ours = probe(engine, histories, cand, args.threads, reps, tmp)
            sess = ort_session(onnx_whole if cand is None else onnx_cand, args.threads)
            theirs, ort_first = time_ort(sess, ort_feeds(histories, cand, max_len, args.items), reps)
            del sess
            results[label] = {"engine": ours, "ort": theirs, "ort_first": [FIRST_ID + i for i in ort_first]}

        repo = tmp / "repository"
        (repo / "b4r").mkdir(parents=True)
        shutil.copytree(engine, repo / "b4r" / "1")
        (repo / "b4r" / "config.pbtxt").write_text(
            'backend: "recsys"\nmax_batch_size: 8\n'
            'instance_group [ { kind: KIND_CPU count: 1 } ]\n'
            f'parameters [ {{ key: "threads" value {{ string_value: "{args.threads}" }} }} ]\n')
        backend = ROOT / "build" / "backends"
        with TritonServer(repo, backend, log_path=tmp / "server.log") as server:
            client = grpcclient.InferenceServerClient(server.grpc_url)
            for label, cand in cases:
                reps = args.reps // 4 if cand is None else args.reps
                print(f"backend: {label} ...", file=sys.stderr)
                p50, compute, first = time_backend(client, grpcclient, histories, cand, reps)
                results[label]["backend"] = p50
                results[label]["compute"] = compute
                results[label]["agree"] = len(set(first) & set(results[label]["ort_first"])) / K

    whole = results["whole catalogue"]
    lines = [
        f"{datetime.date.today().isoformat()}, {platform.node()}, {os.cpu_count()} cores, {args.threads} threads for "
        f"each; onnxruntime {ort.__version__}; BERT4Rec (d = 64, 2 layers, max_len 50), {args.items:,} items, fp32, "
        f"batch 1, k = {K}, history excluded; p50 per request over {args.reps} requests ({args.reps // 4} for the "
        f"whole catalogue)",
        "",
        "| scored | engine ms | backend compute ms (Triton's compute_infer, mean) | client-seen ms (gRPC, p50) | ORT ms "
        "| ORT / engine | engine speed-up over its whole catalogue | top-10 agreement ORT vs backend, first user |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        lines.append(
            f"| {label} | {r['engine'] * 1e3:.3f} | {r['compute'] * 1e3:.3f} | {r['backend'] * 1e3:.3f} | "
            f"{r['ort'] * 1e3:.3f} | "
            f"{r['ort'] / r['engine']:.2f}x | {whole['engine'] / r['engine']:.1f}x | {r['agree']:.1f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
