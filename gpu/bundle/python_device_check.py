"""The Python package's GPU path on a real GPU: each trained fixture converted with recsys.convert,
loaded twice (device="cpu" and device="cuda"), and the same 200 test histories recommended by both
(HSTU's from its own test set, with their event times and the target's time as the query time).
The GPU answers must be the CPU engine's: the same items except where two scores are within the
tolerance of each other (a near-tie may swap), every score within SCORE_ABS_TOL. Exit 0 when every
model agrees.

    PYTHONPATH=BUNDLE/python python3 python_device_check.py BUNDLE/fixtures
"""

from __future__ import annotations

import gzip
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import recsys

# As the backend's device test: different summation orders, and the GPU fuses multiply-adds.
SCORE_ABS_TOL = 2e-4
K = 20
USERS = 200
MODELS = [("bert4rec", "bert4rec"), ("vaecf", "multivae"), ("sasrec", "sasrec"), ("gru4rec", "gru4rec"),
          ("hstu", "hstu")]


def histories(fixtures: Path) -> list[list[int]]:
    rows = (fixtures / "test_set.tsv").read_text().splitlines()[1:USERS + 1]
    return [[int(x) for x in row.split("\t")[2].split()] for row in rows]


def timed_histories(fixtures: Path) -> tuple[list[list[int]], dict]:
    """HSTU's test users: histories and the `timestamps=` / `query_timestamp=` arguments."""
    with gzip.open(fixtures / "hstu" / "test_set.tsv.gz", "rt") as f:
        rows = [line.rstrip("\n").split("\t") for line in f.readlines()[1:USERS + 1]]
    users = [[int(x) for x in row[3].split()] for row in rows]
    times = {"timestamps": [[int(t) for t in row[4].split()] for row in rows],
             "query_timestamp": [int(row[2]) for row in rows]}
    return users, times


def main() -> int:
    fixtures = Path(sys.argv[1])
    failures = 0
    with tempfile.TemporaryDirectory() as work:
        for kind, folder in MODELS:
            if kind == "hstu":
                users, times = timed_histories(fixtures)
                embed_times = {"timestamps": times["timestamps"][:32], "query_timestamp": times["query_timestamp"][:32]}
            else:
                users, times, embed_times = histories(fixtures), {}, {}
            src = fixtures / folder
            out = Path(work) / kind
            recsys.convert(kind, src / "model.safetensors", src / "item_id_map.tsv", out, config=src / "config.json")
            cpu = recsys.Engine(out, threads=4)
            t0 = time.perf_counter()
            gpu = recsys.Engine(out, threads=4, device="cuda")
            load = time.perf_counter() - t0
            want_ids, want_scores = cpu.recommend(users, k=K, **times)
            got_ids, got_scores = gpu.recommend(users, k=K, **times)
            worst = float(np.nanmax(np.abs(np.where(np.isfinite(want_scores), want_scores - got_scores, 0))))
            swapped = 0
            for w_ids, w_scores, g_ids in zip(want_ids, want_scores, got_ids):
                for pos in np.nonzero(w_ids != g_ids)[0]:
                    # A swap is allowed only between items whose CPU scores are within the tolerance.
                    neighbours = np.abs(w_scores - w_scores[pos]) <= 2 * SCORE_ABS_TOL
                    if g_ids[pos] not in set(w_ids[neighbours].tolist()):
                        swapped += 1
            embedded = float(np.max(np.abs(cpu.embed(users[:32], **embed_times)
                                           - gpu.embed(users[:32], **embed_times))))
            ok = worst <= SCORE_ABS_TOL and swapped == 0 and embedded <= SCORE_ABS_TOL
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {kind}: {gpu!r} (load and self-check {load:.2f} s); "
                  f"max |score diff| {worst:.2e}, items out of place beyond near-ties {swapped}, "
                  f"max |embedding diff| {embedded:.2e}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
