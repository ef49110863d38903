"""Offline batch scoring: `recsys predict` against a Python loop over ONNX Runtime on the same
exported model (`recsys export-onnx --k 10` of the same engine), same JSONL input, same output
content (top-10 ids and scores per line), 2 threads each.

    scripts/bench.sh predict [--lines 20000] [--out FILE.md]
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

from bench_models import FIX, RECSYS, K  # noqa: E402


def python_loop(model: str, sess, src: Path, dst: Path, ext_to_int: dict, int_to_ext: list, n: int, max_len: int,
                batch: int) -> None:
    """What a team would write around the exported graph: read lines, map ids, pad, run ORT, write JSON lines."""
    with open(src) as f, open(dst, "w") as out:
        lines = []

        def flush():
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
            values, indices = sess.run(None, feeds)
            for v, ix in zip(values, indices):
                out.write(json.dumps({"item_ids": [int_to_ext[i] for i in ix], "scores": [float(s) for s in v]}) + "\n")
            lines.clear()

        for line in f:
            lines.append(line)
            if len(lines) == batch:
                flush()
        if lines:
            flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=20000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    test = [l.split("\t") for l in (FIX / "test_set.tsv").read_text().splitlines()[1:]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / "users.jsonl"
        with open(src, "w") as f:
            for i in range(args.lines):
                t = test[i % len(test)]
                f.write(json.dumps({"user_id": i, "item_ids": [int(x) for x in t[2].split()]}) + "\n")
        for model, fixture in [("bert4rec", "bert4rec"), ("vaecf", "multivae")]:
            engine = tmp / model
            subprocess.run([str(RECSYS), "convert", "--kind", model, "--checkpoint", str(FIX / fixture / "model.safetensors"),
                            "--config", str(FIX / fixture / "config.json"), "--item-map", str(FIX / fixture / "item_id_map.tsv"),
                            "--out", str(engine)], check=True, capture_output=True)
            start = time.perf_counter()
            subprocess.run([str(RECSYS), "predict", "--engine", str(engine), "--input", str(src), "--output", str(tmp / "ours.jsonl"),
                            "--k", str(K), "--threads", str(args.threads), "--batch-size", "256"], check=True, capture_output=True)
            ours = time.perf_counter() - start
            mapping = [l.split("\t") for l in (FIX / fixture / "item_id_map.tsv").read_text().splitlines()[1:]]
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
            python_loop(model, sess, src, tmp / "theirs.jsonl", ext_to_int, int_to_ext, n, max_len, 256)
            theirs = time.perf_counter() - start
            a = [json.loads(l)["item_ids"] for l in open(tmp / "ours.jsonl")]
            b = [json.loads(l)["item_ids"] for l in open(tmp / "theirs.jsonl")]
            agree = sum(x == y for x, y in zip(a, b)) / len(a)
            rows.append((model, args.lines, ours, theirs, agree))
    lines = [
        f"{datetime.date.today().isoformat()}, {platform.node()}, {os.cpu_count()} cores; {args.threads} threads each; "
        f"batches of 256; top-{K}; times include reading and writing JSON lines (and, for recsys, loading the engine)",
        "",
        "| model | lines | recsys predict s | histories/s | Python + ORT s | histories/s | speed-up | identical top-10 lines |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, n, ours, theirs, agree in rows:
        lines.append(f"| {model} | {n} | {ours:.2f} | {n / ours:.0f} | {theirs:.2f} | {n / theirs:.0f} | {theirs / ours:.1f}x | {100 * agree:.1f} % |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
