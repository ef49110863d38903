"""Whole models at catalogue scale in tritonserver, where the output layer's cost dominates: recsys
(fp32, with the exact int8 screen and without) against the same engine exported with `recsys
export-onnx` and run by Triton's Python backend in onnxruntime, under the real perf_analyzer at
concurrency 1 and 8, and what dynamic batching buys at this scale.

    scripts/bench.sh catalogue [--items 1000000] [--vaecf-items N] [--models bert4rec,vaecf]
                               [--threads 2] [--concurrency 1,8] [--out FILE.md] [--profile]

--profile: `perf record` (Debian's perf) samples the tritonserver process of each recsys variant
during its lowest-concurrency perf_analyzer run, and the top of `perf report` (by shared object and
symbol) is printed after the table, so a slow run comes with where its time went.

Models (random weights: no trained model of this size is available here, and the cost does not
depend on the values; the screen's survivor counts do, and are reported):
  - BERT4Rec: the fixture's trained encoder (d = 64, 2 layers, 2 heads, max_len 50) with a random
    item table of --items rows (as scripts/bench_candidates.py builds it);
  - Mult-VAE: items -> 600 -> 200 (mu of a 400-wide last encoder layer) -> 600 -> items, RecBole's
    shape, --vaecf-items items (default --items).

Each served variant gets its own tritonserver, started, measured and stopped in turn, so that one
model's memory at a time is resident (a 1e6-item Mult-VAE is 4.8 GB of fp32 weights):
  - <model>_screen: recsys, `--screen int8`, dynamic batching (100 us), 1 instance, --threads;
  - <model>_plain: recsys, the same engine without the screen;
  - <model>_screen_b1: the screened engine with max_batch_size 1 (every request alone: the batch 1
    side of what dynamic batching buys);
  - <model>_peer, <model>_peer_ov, <model>_peer_ovd: the plain engine exported with `recsys
    export-onnx --k 10` (external data above 1 GiB), benches/triton_peer/model.py, in ONNX Runtime,
    OpenVINO with f32 forced and OpenVINO at its default precision, --threads intra-op threads,
    dynamic batching (100 us), 1 instance.
Requests: 256 random histories of 5-100 catalogue items (ragged), gRPC. Every perf_analyzer run is
bounded (2 s windows, at most 8 trials, a timeout) and every server is stopped.
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
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from bench_models import read_safetensors  # noqa: E402
from bench_peers import backend_directory, peer_config  # noqa: E402
from bench_serving import cell, measure, ratio, spread  # noqa: E402
from triton_harness import TritonServer  # noqa: E402

RECSYS = ROOT / "target" / "release" / "recsys"
FIX = ROOT / "tests" / "fixtures"
FIRST_ID = 10_000_000
USERS = 256

def recsys_config(name: str, max_batch: int, threads: int) -> str:
    """The peer's config (same inputs, outputs, batching and instance) for the recsys backend."""
    return (peer_config(name, runtime=None)
            .replace('backend: "python"', 'backend: "recsys"')
            .replace("max_batch_size: 64", f"max_batch_size: {max_batch}")
            .replace('string_value: "1"', f'string_value: "{threads}"'))


def scaled(a: np.ndarray, factor: float) -> np.ndarray:
    a *= factor
    return a


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """safetensors (F32), each tensor written from its own buffer (no copy of a multi-GB table)."""
    header, offset = {}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for t in tensors.values():
            f.write(np.ascontiguousarray(t, dtype=np.float32).data)


def checkpoints(kind: str, items: int, tmp: Path) -> tuple[Path, Path, Path]:
    """A random-weight checkpoint of `kind` with `items` items: (checkpoint, config, item map)."""
    rng = np.random.default_rng(7)
    ckpt, cfg, item_map = tmp / f"{kind}.safetensors", tmp / f"{kind}.json", tmp / f"{kind}_map.tsv"
    if kind == "bert4rec":
        w = read_safetensors(FIX / "bert4rec" / "model.safetensors")
        trained = w["item_embedding.weight"]
        w["item_embedding.weight"] = (rng.standard_normal((items + 2, trained.shape[1]), dtype=np.float32)
                                      * float(trained.std()))
        w["output_bias"] = rng.standard_normal(items + 1, dtype=np.float32) * float(w["output_bias"].std())
        config = json.loads((FIX / "bert4rec" / "config.json").read_text())
        config["n_real_items"] = items
        for key in ("recbole_n_items", "item_embedding_rows", "mask_index"):
            config.pop(key, None)
    else:
        w = {
            "encoder.0.weight": scaled(rng.standard_normal((600, items + 1), dtype=np.float32), 0.02),
            "encoder.0.bias": rng.standard_normal(600, dtype=np.float32) * 0.02,
            "encoder.2.weight": rng.standard_normal((400, 600), dtype=np.float32) * 0.05,
            "encoder.2.bias": rng.standard_normal(400, dtype=np.float32) * 0.02,
            "decoder.0.weight": rng.standard_normal((600, 200), dtype=np.float32) * 0.05,
            "decoder.0.bias": rng.standard_normal(600, dtype=np.float32) * 0.02,
            "decoder.2.weight": scaled(rng.standard_normal((items + 1, 600), dtype=np.float32), 0.05),
            "decoder.2.bias": rng.standard_normal(items + 1, dtype=np.float32) * 0.02,
        }
        config = {"n_real_items": items, "mlp_hidden_size": [600], "latent_dimension": 400}
    write_safetensors(ckpt, w)
    del w
    cfg.write_text(json.dumps(config))
    item_map.write_text("".join(f"{i}\t{FIRST_ID + i}\n" for i in range(1, items + 1)))
    return ckpt, cfg, item_map


def convert(kind: str, ckpt: Path, cfg: Path, item_map: Path, out: Path, extra: list[str]) -> float:
    started = time.monotonic()
    subprocess.run([str(RECSYS), "convert", "--kind", kind, "--checkpoint", str(ckpt), "--config", str(cfg),
                    "--item-map", str(item_map), "--out", str(out), *extra], check=True, capture_output=True,
                   timeout=1800)
    return time.monotonic() - started


def input_data(path: Path, items: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    histories = [[FIRST_ID + 1 + int(j) for j in rng.choice(items, size=int(rng.integers(5, 101)), replace=False)]
                 for _ in range(USERS)]
    path.write_text(json.dumps({"data": [{"ITEM_IDS": {"content": h, "shape": [len(h)]}} for h in histories]}))
    return histories


def top10(server: TritonServer, model: str, histories: list[list[int]]) -> list[list[int]]:
    import tritonclient.grpc as grpcclient  # noqa: PLC0415

    client = grpcclient.InferenceServerClient(server.grpc_url)
    out = []
    for h in histories:
        arr = np.array([h], dtype=np.int64)
        inp = grpcclient.InferInput("ITEM_IDS", list(arr.shape), "INT64")
        inp.set_data_from_numpy(arr)
        out.append(client.infer(model, [inp]).as_numpy("TOP_ITEM_IDS").reshape(-1).tolist())
    client.close()
    return out


def survivors(server: TritonServer, model: str) -> tuple[float, float]:
    """(observations, mean) of recsys_screen_survivors for `model`."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("recsys_screen_survivors_") and f'model="{model}"' in line:
            values[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    count = values.get("recsys_screen_survivors_count", 0.0)
    return count, values.get("recsys_screen_survivors_sum", 0.0) / max(count, 1.0)


def resident_mib(server: TritonServer) -> float:
    """Resident memory of the server and its children (the Python backend's stub), MiB."""
    pids = [server.process.pid]
    children = subprocess.run(["pgrep", "-P", str(server.process.pid)], capture_output=True, text=True).stdout.split()
    pids += [int(p) for p in children]
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return total / 1024


def start_sampling(server: TritonServer, path: Path) -> subprocess.Popen:
    """`perf record` of the server process (all its threads) until stop_sampling."""
    return subprocess.Popen(["perf", "record", "-q", "-F", "499", "-p", str(server.process.pid), "-o", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_sampling(sampler: subprocess.Popen, path: Path, top: int = 25) -> str:
    """Stops the sampler and returns the top of its report."""
    sampler.send_signal(2)  # SIGINT: perf writes its data and exits
    sampler.wait(timeout=120)
    report = subprocess.run(["perf", "report", "-i", str(path), "--no-children", "--sort", "dso,symbol", "--stdio"],
                            capture_output=True, text=True, timeout=600).stdout
    lines = [l.rstrip() for l in report.splitlines() if l.strip() and not l.startswith("#")]
    return "\n".join(lines[:top])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--vaecf-items", type=int)
    parser.add_argument("--models", default="bert4rec,vaecf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--workdir", type=Path, help="keep the checkpoints, engines and exports here")
    parser.add_argument("--profile", action="store_true",
                        help="sample each recsys server with perf during its lowest-concurrency run")
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    site = sysconfig.get_paths()["purelib"]
    os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    os.environ["LD_LIBRARY_PATH"] = f"{site}/nvidia_pytriton.libs:{os.environ.get('LD_LIBRARY_PATH', '')}"
    results, notes, profiles = [], [], []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tmp = Path(tmp)
        backends = backend_directory(tmp)
        for kind in args.models.split(","):
            items = args.vaecf_items if kind == "vaecf" and args.vaecf_items else args.items
            work = tmp / kind
            work.mkdir()
            print(f"{kind}: {items} items: writing the checkpoint ...", file=sys.stderr, flush=True)
            ckpt, cfg, item_map = checkpoints(kind, items, work)
            plain, screened = work / "engine_plain", work / "engine_screen"
            t_plain = convert(kind, ckpt, cfg, item_map, plain, [])
            t_screen = convert(kind, ckpt, cfg, item_map, screened, ["--screen", "int8"])
            ckpt.unlink()
            onnx_dir = work / "peer" / "1"
            onnx_dir.mkdir(parents=True)
            subprocess.run([str(RECSYS), "export-onnx", "--engine", str(plain), "--out", str(onnx_dir / "model.onnx"),
                            "--k", "10"], check=True, capture_output=True, timeout=1800)
            data = work / "histories.json"
            histories = input_data(data, items)
            notes.append(f"{kind}: {items:,} items, convert {t_plain:.0f} s (screened {t_screen:.0f} s), "
                         f"engine {sum(f.stat().st_size for f in plain.iterdir()) / 2**30:.2f} GiB")
            variants = [
                (f"{kind}_screen", screened, 64, concurrency),
                (f"{kind}_plain", plain, 64, concurrency),
                (f"{kind}_screen_b1", screened, 1, [max(concurrency)]),
                (f"{kind}_peer", "onnxruntime", None, concurrency),
                (f"{kind}_peer_ov", "openvino", None, concurrency),
                (f"{kind}_peer_ovd", "openvino-default", None, concurrency),
            ]
            answers = {}
            for name, engine, max_batch, levels in variants:
                repo = work / f"repo_{name}"
                (repo / name).mkdir(parents=True)
                if isinstance(engine, Path):
                    (repo / name / "1").symlink_to(engine)
                    (repo / name / "config.pbtxt").write_text(
                        recsys_config(name, max_batch, args.threads))
                else:
                    # The one export (and its external data), linked into each peer's version folder.
                    (repo / name / "1").mkdir()
                    for f in (work / "peer" / "1").iterdir():
                        (repo / name / "1" / f.name).symlink_to(f)
                    shutil.copy2(ROOT / "benches" / "triton_peer" / "model.py", repo / name / "1" / "model.py")
                    shutil.copy2(plain / "item_ids.tsv", repo / name / "item_ids.tsv")
                    runtime, precision = (engine, "f32") if engine != "openvino-default" else ("openvino", "default")
                    (repo / name / "config.pbtxt").write_text(
                        peer_config(name, runtime, precision).replace('string_value: "1"',
                                                                      f'string_value: "{args.threads}"', 1))
                print(f"{name}: starting tritonserver ...", file=sys.stderr, flush=True)
                started = time.monotonic()
                server = TritonServer(repo, backends, log_path=work / f"{name}.log")
                try:
                    server.start(timeout=900)
                    load_s = time.monotonic() - started
                    answers[name] = top10(server, name, histories[:50])
                    rss = resident_mib(server)
                    for c in levels:
                        sampler = None
                        if args.profile and isinstance(engine, Path) and c == min(levels):
                            sampler = start_sampling(server, work / f"{name}.perf.data")
                        r = measure(server, name, "grpc", c, data, work / f"{name}-{c}.csv")
                        if sampler is not None:
                            profiles.append((name, c, stop_sampling(sampler, work / f"{name}.perf.data")))
                        r["load_s"], r["rss_mib"] = load_s, rss
                        r["survivors"] = survivors(server, name) if "screen" in name else None
                        results.append((kind, items, name, c, r))
                finally:
                    server.stop()
            same = lambda a, b: sum(x == y for x, y in zip(answers[a], answers[b])) / len(answers[a])  # noqa: E731
            notes.append(f"{kind}: identical top-10 on 50 users: screened vs plain {100 * same(f'{kind}_screen', f'{kind}_plain'):.0f} %, "
                         f"screened vs peer {100 * same(f'{kind}_screen', f'{kind}_peer'):.0f} %")
            shutil.rmtree(work)
    today = datetime.date.today().isoformat()
    by = {(kind, name, c): r for kind, _, name, c, r in results}
    out = [
        f"{today}, {platform.node()}: {os.cpu_count()} cores, tritonserver 2.51.0, gRPC, perf_analyzer -p 2000 -s 20 "
        f"--max-trials 8, {USERS} random histories of 5-100 items (ragged), random weights, {args.threads} threads for "
        "recsys and for each peer (ONNX Runtime, OpenVINO f32, OpenVINO default), 1 instance each, one server per "
        "variant.",
        "",
        *[f"- {n}" for n in notes],
        "",
        "| model | items | variant | concurrency | infer/s | vs ORT peer | vs OpenVINO f32 peer | vs OpenVINO default peer | "
        "p50 ms | p99 ms | p99 vs ORT peer | compute share | mean survivors | load s | resident MiB | windows infer/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, items, name, c, r in results:
        peer = by.get((kind, f"{kind}_peer", c))
        vs_ort = ratio(r, peer, "throughput") if peer else "-"
        ov = [by.get((kind, f"{kind}_peer_{s}", c)) for s in ("ov", "ovd")]
        ov_ratio = [ratio(r, o, "throughput") if o else "-" for o in ov]
        p99 = ratio(r, peer, "p99_ms") if peer else "-"
        surv = f"{r['survivors'][1]:.0f}" if r["survivors"] else "-"
        out.append(f"| {kind} | {items:,} | {name.removeprefix(kind + '_')} | {c} | {cell(r, 'throughput', digits=0)} | "
                   f"{vs_ort} | {ov_ratio[0]} | {ov_ratio[1]} | "
                   f"{cell(r, 'p50_ms', digits=2)} | {cell(r, 'p99_ms', digits=2)} | {p99} | "
                   f"{cell(r, 'compute_share', 100, 0)} % | {surv} | {r['load_s']:.1f} | {r['rss_mib']:.0f} | {spread(r)} |")
    for name, c, report in profiles:
        out += ["", f"`perf record` of the {name} server during concurrency {c} (share of samples, by shared "
                    "object and symbol, top entries):", "", "```", report, "```"]
    table = "\n".join(out) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
