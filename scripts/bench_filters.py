"""Item set filters in the catalogue scan: recsys's fused top-k with eligible-item masks against its
own unfiltered scan, and FAISS (IndexFlatIP, the peer for the catalogue scan) with an
IDSelectorBitmap against its own unfiltered search, each measured in one run with the variants
interleaved; equal threads for both.

    .venv/peers/bin/python scripts/bench_filters.py [--items 1000000] [--d 64] [--batch 1,64]
                                                   [--k 10] [--threads 1] [--reps 15]

recsys runs in benches/src/bin/filter_probe (cargo build --release -p recsys-benches); FAISS in
this process. Filters keep a random share of the catalogue (the same mask for every row: a
category page). Prints a markdown table per batch size with the CPU model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np
from cpu_info import cpu_model

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "target" / "release" / "filter_probe"
SHARES = [1.0, 0.5, 0.1, 0.05, 0.01, 0.001]


def recsys(n: int, d: int, batch: int, k: int, threads: int, reps: int) -> dict[str, float]:
    out = subprocess.run([str(PROBE), str(n), str(d), str(batch), str(k), "fp32", str(threads), str(reps)],
                         check=True, capture_output=True, text=True, timeout=1800).stdout
    return {v["variant"]: v["median_ms"] for v in json.loads(out)["variants"]}


def faiss_times(n: int, d: int, batch: int, k: int, threads: int, reps: int) -> dict[str, float]:
    import faiss

    faiss.omp_set_num_threads(threads)
    rng = np.random.default_rng(7)
    # [embedding, bias] rows against [hidden, 1] queries: the model's scores as inner products.
    items = rng.uniform(-0.1, 0.1, size=(n, d + 1)).astype(np.float32)
    queries = np.concatenate([rng.uniform(-1, 1, size=(batch, d)), np.ones((batch, 1))], axis=1).astype(np.float32)
    index = faiss.IndexFlatIP(d + 1)
    index.add(items)
    variants: dict[str, object] = {"none": None}
    for share in SHARES:
        keep = rng.random(n) < share
        bitmap = np.packbits(keep, bitorder="little")
        variants[f"page {share:g}"] = faiss.SearchParameters(sel=faiss.IDSelectorBitmap(n, faiss.swig_ptr(bitmap)))
        variants[f"page {share:g}"].bitmap_ref = bitmap  # keep the bytes alive
    variants["none, again"] = None
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, params in variants.items():
            start = time.perf_counter()
            if params is None:
                index.search(queries, k)
            else:
                index.search(queries, k, params=params)
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--batch", default="1,64")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; {args.items} items, d = {args.d}, k = {args.k}, {args.threads} thread(s), "
          f"median of {args.reps}")
    for batch in [int(b) for b in args.batch.split(",")]:
        ours = recsys(args.items, args.d, batch, args.k, args.threads, args.reps)
        theirs = faiss_times(args.items, args.d, batch, args.k, args.threads, args.reps)
        print(f"\nbatch {batch}\n")
        print("| filter keeps | recsys ms | recsys / unfiltered | FAISS ms | FAISS / unfiltered | recsys speed-up over FAISS |")
        print("|---|---|---|---|---|---|")
        for name in ["none"] + [f"page {s:g}" for s in SHARES] + ["none, again"]:
            fixed = {"none": "(unfiltered)", "none, again": "(unfiltered, again: the noise)"}
            label = fixed[name] if name in fixed else f"{float(name.split()[1]) * 100:g} %"
            r, f = ours[name], theirs[name]
            print(f"| {label} | {r:.3f} | {r / ours['none']:.2f} | {f:.3f} | {f / theirs['none']:.2f} | {f / r:.2f}x |")


if __name__ == "__main__":
    main()
