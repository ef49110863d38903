"""The catalogue scan against FAISS: a user who takes recsys's user embedding and searches the item
table `recsys export-items` writes with FAISS `IndexFlatIP` (exact inner product, the ANN-free
baseline every FAISS user starts from) instead of letting the engine score the catalogue.

    scripts/bench.sh catalogue [--items 1000000] [--threads 2] [--out FILE.md]
    (this table first, written to FILE.faiss.md; then the serving table of bench_catalogue.py)

Model: BERT4Rec with the fixture's trained encoder (d = 64) and a random item table of --items rows,
as bench_catalogue.py builds it; fp32 and `--screen int8` engines. Histories: random, 5-100 items.

recsys: `model_probe` (encode + score every item + top-10 with the history excluded), median per
batch, batch 1 and 64, --threads threads. FAISS side: the same histories' encoder alone
(`model_probe` with k = 0: encoded, nothing scored) plus `index.search` for the top 10 + the longest
history of the batch (so that the history can be left out afterwards, as the engine does; that
filtering is not timed), FAISS on --threads OpenMP threads. Both sides alternate for two rounds and
keep their best median. Agreement: the top-10 ids of the first history, FAISS's against recsys's.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests" / "integration"))
import faiss  # noqa: E402

from bench_catalogue import FIRST_ID, checkpoints, convert  # noqa: E402
from bench_models import PROBE, RECSYS  # noqa: E402

K = 10


def probe(engine: Path, histories: Path, batch: int, k: int, threads: int, reps: int) -> dict:
    out = subprocess.run([str(PROBE), str(engine), str(histories), str(batch), str(k), str(threads), str(reps)],
                         check=True, capture_output=True, text=True, timeout=1800)
    return json.loads(out.stdout)


def embeddings(engine: Path, histories: list[list[int]], tmp: Path) -> np.ndarray:
    """Every history's [h, 1] from `recsys predict --return-embedding`."""
    src, dst = tmp / "users.jsonl", tmp / "embedded.jsonl"
    src.write_text("".join(json.dumps({"item_ids": h, "k": 1, "return_embedding": True}) + "\n" for h in histories))
    subprocess.run([str(RECSYS), "predict", "--engine", str(engine), "--input", str(src), "--output", str(dst)],
                   check=True, capture_output=True, timeout=1800)
    return np.array([json.loads(line)["embedding"] for line in dst.read_text().splitlines()], dtype=np.float32)


def faiss_search(index, queries: np.ndarray, histories: list[list[int]], batch: int, reps: int) -> float:
    """Median seconds of `index.search` per batch, over batches cycling through the histories."""
    times = []
    for r in range(reps + 1):
        rows = [(r * batch + i) % len(histories) for i in range(batch)]
        depth = K + max(len(histories[i]) for i in rows)
        q = np.ascontiguousarray(queries[rows])
        start = time.perf_counter()
        index.search(q, depth)
        if r:  # the first search warms the index up
            times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args, _ = parser.parse_known_args()
    faiss.omp_set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print(f"faiss: {args.items} items: writing the checkpoint and engines ...", file=sys.stderr, flush=True)
        ckpt, cfg, item_map = checkpoints("bert4rec", args.items, tmp)
        plain, screened = tmp / "plain", tmp / "screened"
        convert("bert4rec", ckpt, cfg, item_map, plain, [])
        convert("bert4rec", ckpt, cfg, item_map, screened, ["--screen", "int8"])
        ckpt.unlink()
        rng = np.random.default_rng(11)
        histories = [[FIRST_ID + 1 + int(j) for j in rng.choice(args.items, size=int(rng.integers(5, 101)), replace=False)]
                     for _ in range(256)]
        hist_path = tmp / "histories.json"
        hist_path.write_text(json.dumps(histories))
        subprocess.run([str(RECSYS), "export-items", "--engine", str(plain), "--output", str(tmp / "items")],
                       check=True, capture_output=True, timeout=1800)
        items = np.load(tmp / "items.npy")
        ids = np.array([int(x) for x in (tmp / "items.ids.txt").read_text().split()], dtype=np.int64)
        index = faiss.IndexFlatIP(items.shape[1])
        index.add(items)
        del items
        queries = embeddings(plain, histories, tmp)
        # The first history's FAISS top 10, its own items left out, for the agreement column.
        _, hits = index.search(queries[:1], K + len(histories[0]))
        own = set(histories[0])
        faiss_first = [int(ids[h]) for h in hits[0] if int(ids[h]) not in own][:K]
        for batch in (1, 64):
            reps = 100 if batch == 1 else 12
            best = {}
            for _ in range(2):
                for name, engine in (("fp32", plain), ("screened", screened)):
                    run = probe(engine, hist_path, batch, K, args.threads, reps)
                    if name not in best or run["median_s"] < best[name]["median_s"]:
                        best[name] = run
                encode = probe(plain, hist_path, batch, 0, args.threads, reps)["median_s"]
                search = faiss_search(index, queries, histories, batch, reps)
                if "faiss" not in best or encode + search < best["faiss"][0] + best["faiss"][1]:
                    best["faiss"] = (encode, search)
            encode, search = best["faiss"]
            agree = len(set(best["fp32"]["top_first"]) & set(faiss_first)) / K
            rows.append((batch, best["fp32"]["median_s"], best["screened"]["median_s"], encode, search, agree))
    lines = [
        f"{datetime.date.today().isoformat()}, {platform.node()}, {os.cpu_count()} cores, {args.threads} threads each; "
        f"FAISS {faiss.__version__} IndexFlatIP over `recsys export-items`; BERT4Rec, d = 64, {args.items:,} items, "
        f"top-{K} with the history excluded; each side's best median of two alternating rounds",
        "",
        "| batch | recsys fp32 ms | recsys screened ms | recsys encoder alone ms | FAISS search ms | "
        "encoder + FAISS / recsys fp32 | encoder + FAISS / recsys screened | top-10 agreement, first history |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for batch, fp32, screen, encode, search, agree in rows:
        peer = encode + search
        lines.append(f"| {batch} | {1000 * fp32:.3f} | {1000 * screen:.3f} | {1000 * encode:.3f} | {1000 * search:.3f} | "
                     f"**{peer / fp32:.2f}** | **{peer / screen:.2f}** | {agree:.1f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.with_suffix(".faiss.md").write_text(table)


if __name__ == "__main__":
    main()
