"""Growing sessions through the Python package: the per-event latency of `recsys.Engine.recommend`
called with a user's whole history, one event longer on every call, with the engine's prefix
cache (`prefix_cache_bytes`) and without it.

    scripts/bench.sh python-sessions [--model hstu|sasrec|gru4rec] [--threads 2] [--out FILE.md]

The models of `bench_sessions.py` (MovieLens-1M's shapes, random weights; HSTU: the official
"large" ML-1M config, events an hour apart, each call at the next event's time), on histories of
at least 200 distinct items. Batch 1 (24 users, one after the other) and 64 (two groups of 64
users, each call carrying the whole group); the table gives the median latency of the call that
brings the histories to 10, 50, 100 and 200 events (top-10, history excluded). The two engines
replay alternately, twice, each keeping its best median.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import RECSYS, ml1m_histories  # noqa: E402
from bench_sequential import ml1m_model  # noqa: E402
from bench_sessions import LENGTHS  # noqa: E402
from cpu_info import cpu_model  # noqa: E402

# The first event's time of every session (HSTU reads time); events are an hour apart.
T0 = 1_600_000_000


def replay(engine, groups: list[list[list[int]]], timed: bool) -> dict[int, float]:
    """Median seconds of the call bringing each group's histories to each length in LENGTHS."""
    times: dict[int, list[float]] = {t: [] for t in LENGTHS}
    clock = [T0 + 3600 * p for p in range(max(LENGTHS) + 1)]
    for users in groups:
        for t in range(1, max(LENGTHS) + 1):
            prefixes = [h[:t] for h in users]
            extra = {"timestamps": [clock[:t]] * len(users), "query_timestamp": clock[t]} if timed else {}
            start = time.perf_counter()
            engine.recommend(prefixes, k=10, **extra)
            elapsed = time.perf_counter() - start
            if t in times:
                times[t].append(elapsed)
    return {t: float(np.median(v)) for t, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gru4rec", "sasrec", "hstu"], default="hstu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import recsys  # noqa: PLC0415  (the wheel in the environment running this script)

    rng = np.random.default_rng(44)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt, cfg_path, map_path = ml1m_model(args.model, tmp, rng)
        engine_dir = tmp / args.model
        subprocess.run([str(RECSYS), "convert", "--kind", args.model, "--checkpoint", str(ckpt), "--config",
                        str(cfg_path), "--item-map", str(map_path), "--out", str(engine_dir)],
                       check=True, capture_output=True)
        ext = sorted(int(line.split("\t")[1]) for line in map_path.read_text().splitlines()[1:])
        histories = [h for h in ml1m_histories(ext, rng, count=4000) if len(h) >= max(LENGTHS)]
        timed = args.model == "hstu"
        rows = []
        for batch, groups in [(1, 24), (64, 2)]:
            chunks = [histories[g * batch:(g + 1) * batch] for g in range(groups)]
            best: dict[str, dict[int, float]] = {}
            stats = None
            for _ in range(2):
                for cache in (True, False):
                    engine = recsys.Engine(str(engine_dir), threads=args.threads,
                                           prefix_cache_bytes=(1 << 30) if cache else 0)
                    got = replay(engine, chunks, timed)
                    key = "on" if cache else "off"
                    best[key] = got if key not in best else {t: min(best[key][t], got[t]) for t in got}
                    if cache:
                        stats = engine.prefix_cache_stats
            rows.append((batch, best, stats))
    label = {"gru4rec": "GRU4Rec", "sasrec": "SASRec", "hstu": "HSTU"}[args.model]
    lines = [f"{label} through the Python package (recsys.Engine.recommend): {datetime.date.today().isoformat()}, "
             f"CPU (lscpu): {cpu_model()}; {args.threads} threads; MovieLens-1M's shapes, random weights; median "
             "latency of the call that brings every history of the batch to that many events",
             "",
             "| batch | events | cache on ms | cache off ms | off / on |",
             "|---|---|---|---|---|"]
    for batch, best, _ in rows:
        for t in LENGTHS:
            on, off = best["on"][t], best["off"][t]
            lines.append(f"| {batch} | {t} | {on * 1e3:.3f} | {off * 1e3:.3f} | {off / on:.2f} |")
    stats = rows[0][2]
    lines += ["", f"Cache counters (batch 1, last replay): {json.dumps(stats)}."]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
