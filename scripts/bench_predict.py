"""Offline batch scoring: `recsys predict` against a Python loop over ONNX Runtime on the same
exported model (`recsys export-onnx --k 10` of the same engine), same JSONL input, same output
content (top-10 ids and scores per line), 2 threads each. The peer's time is given whole (reading,
id mapping, padding, writing) and for its `session.run` calls alone; the model as a user exports
it from PyTorch runs in ONNX Runtime and OpenVINO (f32 forced, and its default precision) on the
same batches, inference alone.

    scripts/bench.sh predict [--lines 20000] [--shape fixture|ml1m] [--batch-size 256] [--out FILE.md]

--shape fixture: the trained fixtures (2,000 items) on the fixture's test histories. --shape ml1m:
MovieLens-1M's shapes with random weights (BERT4Rec 3,416 items, L = 200, 2 layers, 2 heads, 64/256;
Mult-VAE 3,416 items, 600-200-600) on histories with MovieLens-1M's lengths (median 96, mean 165).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import onnxruntime as ort  # noqa: E402

from bench_models import (FIX, RECSYS, K, bert4rec_feeds, ov, bert4rec_session, ml1m_bert4rec, ml1m_histories,  # noqa: E402
                          random_multivae, read_safetensors, vaecf_feeds, vaecf_session)


def python_loop(model: str, sess, src: Path, dst: Path, ext_to_int: dict, int_to_ext: list, n: int, max_len: int,
                batch: int) -> float:
    """What a team would write around the exported graph: read lines, map ids, pad, run ORT, write JSON
    lines. Returns the seconds spent in `session.run`."""
    in_run = 0.0
    with open(src) as f, open(dst, "w") as out:
        lines = []

        def flush():
            nonlocal in_run
            histories = [[ext_to_int[x] for x in json.loads(l)["item_ids"] if x in ext_to_int] for l in lines]
            width = max(1, max(len(h) for h in histories))
            exclude = np.zeros((len(histories), width), dtype=np.int64)
            for i, h in enumerate(histories):
                exclude[i, : len(h)] = h
            if model == "bert4rec":
                seq = np.zeros((len(histories), max_len), dtype=np.int64)
                for i, h in enumerate(histories):
                    ids = h[-(max_len - 1):]
                    seq[i, : len(ids)] = ids
                    seq[i, len(ids)] = n + 1
                feeds = {"item_seq": seq, "exclude_ids": exclude}
            else:
                feeds = {"items": exclude, "exclude_ids": exclude}
            start = time.perf_counter()
            values, indices = sess.run(None, feeds)
            in_run += time.perf_counter() - start
            for v, ix in zip(values, indices):
                out.write(json.dumps({"item_ids": [int_to_ext[i] for i in ix], "scores": [float(s) for s in v]}) + "\n")
            lines.clear()

        for line in f:
            lines.append(line)
            if len(lines) == batch:
                flush()
        if lines:
            flush()
    return in_run


def models(shape: str, tmp: Path) -> list[tuple[str, Path, Path, Path, list[list[int]]]]:
    """(kind, checkpoint, config, item map, histories) of each model of `shape`."""
    if shape == "fixture":
        test = [l.split("\t") for l in (FIX / "test_set.tsv").read_text().splitlines()[1:]]
        histories = [[int(x) for x in t[2].split()] for t in test]
        return [(kind, FIX / sub / "model.safetensors", FIX / sub / "config.json", FIX / sub / "item_id_map.tsv", histories)
                for kind, sub in [("bert4rec", "bert4rec"), ("vaecf", "multivae")]]
    rng = np.random.default_rng(11)
    out = []
    ckpt, cfg, item_map = ml1m_bert4rec(tmp, rng)
    ext = [int(l.split("\t")[1]) for l in item_map.read_text().splitlines()[1:]]
    out.append(("bert4rec", ckpt, cfg, item_map, ml1m_histories(ext, rng)))
    _, ckpt, cfg, item_map, ext = random_multivae(tmp, rng, 3416)
    out.append(("vaecf", ckpt, cfg, item_map, ml1m_histories(ext, rng)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=20000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shape", choices=["fixture", "ml1m"], default="fixture")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for model, ckpt, cfg, item_map, histories in models(args.shape, tmp):
            src = tmp / f"{model}_users.jsonl"
            with open(src, "w") as f:
                for i in range(args.lines):
                    f.write(json.dumps({"user_id": i, "item_ids": histories[i % len(histories)]}) + "\n")
            engine = tmp / model
            subprocess.run([str(RECSYS), "convert", "--kind", model, "--checkpoint", str(ckpt), "--config", str(cfg),
                            "--item-map", str(item_map), "--out", str(engine)], check=True, capture_output=True)
            start = time.perf_counter()
            subprocess.run([str(RECSYS), "predict", "--engine", str(engine), "--input", str(src), "--output", str(tmp / "ours.jsonl"),
                            "--k", str(K), "--threads", str(args.threads), "--batch-size", str(args.batch_size)],
                           check=True, capture_output=True)
            ours = time.perf_counter() - start
            mapping = [l.split("\t") for l in item_map.read_text().splitlines()[1:]]
            ext_to_int = {int(e): int(i) for i, e in mapping}
            int_to_ext = [0] * (len(mapping) + 1)
            for i, e in mapping:
                int_to_ext[int(i)] = int(e)
            n = len(mapping)
            onnx_file = tmp / f"{model}.onnx"
            subprocess.run([str(RECSYS), "export-onnx", "--engine", str(engine), "--out", str(onnx_file), "--k", str(K)],
                           check=True, capture_output=True)
            opts = ort.SessionOptions()
            opts.intra_op_num_threads, opts.inter_op_num_threads = args.threads, 1
            sess = ort.InferenceSession(str(onnx_file), opts, providers=["CPUExecutionProvider"])
            max_len = int(sess.get_modelmeta().custom_metadata_map.get("recsys.max_len", "0"))
            start = time.perf_counter()
            in_run = python_loop(model, sess, src, tmp / "theirs.jsonl", ext_to_int, int_to_ext, n, max_len, args.batch_size)
            theirs = time.perf_counter() - start
            # The model as a user exports it from PyTorch (dense inputs, TopK-free logits), its
            # session.run alone over the same histories in the same batches, inputs built untimed.
            w = read_safetensors(ckpt)
            config = json.loads(cfg.read_text())
            if model == "bert4rec":
                peers = bert4rec_session(w, config, args.threads)
                feed = lambda hs: bert4rec_feeds(hs, ext_to_int, config["max_seq_length"], n)  # noqa: E731
            else:
                peers = vaecf_session(w, n + 1, 200, args.threads)
                feed = lambda hs: vaecf_feeds(hs, ext_to_int, n)  # noqa: E731
            # Every peer runtime (ONNX Runtime, OpenVINO f32 and default) on the same batches.
            user_run = {name: 0.0 for name in peers.runners}
            every = [histories[i % len(histories)] for i in range(args.lines)]
            for first in range(0, args.lines, args.batch_size):
                feeds = feed(every[first:first + args.batch_size])
                for name, run in peers.runners.items():
                    start = time.perf_counter()
                    run(feeds)
                    user_run[name] += time.perf_counter() - start
            a = [json.loads(l)["item_ids"] for l in open(tmp / "ours.jsonl")]
            b = [json.loads(l)["item_ids"] for l in open(tmp / "theirs.jsonl")]
            agree = sum(x == y for x, y in zip(a, b)) / len(a)
            rows.append((model, n, args.lines, ours, theirs, in_run, user_run, agree))
    peer_names = list(rows[0][6]) if rows else ["ORT"]
    lines = [
        f"{datetime.date.today().isoformat()}, {platform.node()}, {os.cpu_count()} cores; {args.threads} threads each; "
        f"{args.shape} shapes; batches of {args.batch_size}; top-{K}; onnxruntime {ort.__version__}"
        + (f", OpenVINO {ov.__version__.split('-')[0]}" if ov is not None else "")
        + "; times include reading and writing JSON lines "
        "(and, for recsys, loading the engine); Python + ORT runs the graph `recsys export-onnx --k 10` writes, "
        "its session.run calls also timed alone; 'PyTorch-style graph' is the model as a user exports it from "
        "PyTorch (dense multi-hot or padded sequence and an exclusion mask in, TopK in the graph), inference alone, "
        "in ONNX Runtime, OpenVINO with f32 forced, and OpenVINO at its default precision",
        "",
        "| model | items | lines | recsys predict s | histories/s | Python + ORT s | speed-up | "
        "its session.run alone s | speed-up | "
        + " | ".join(f"PyTorch-style graph, {p} alone s" for p in peer_names)
        + " | faster f32 peer alone / recsys | identical top-10 lines (exported graph) |",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * len(peer_names) + "---|---|",
    ]
    for model, items, n, ours, theirs, in_run, user_run, agree in rows:
        fastest = min(t for p, t in user_run.items() if p != "OV default")
        lines.append(f"| {model} | {items} | {n} | {ours:.2f} | {n / ours:.0f} | {theirs:.2f} | {theirs / ours:.2f}x | "
                     f"{in_run:.2f} | {in_run / ours:.2f}x | " + " | ".join(f"{user_run[p]:.2f}" for p in peer_names)
                     + f" | {fastest / ours:.2f}x | {100 * agree:.1f} % |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
