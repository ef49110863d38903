"""Offline scoring throughput: recsys.ray.predict on a local Ray cluster (1 and 2 actors, one scoring
thread each) against `recsys predict --threads 1/2` on the same JSON-lines input, JSON lines out
for both, in one run (repetitions interleaved, median reported). Users/s counts the whole job: for
`recsys predict` the process (engine load included), for Ray the job from the dataset to the
written files (actor start and engine load included; the cluster is started once, before).

The local cluster has 3 logical CPUs on this machine's 2 cores: one per actor and one for Ray
Data's read and write tasks (recsys.ray refuses a pool holding every CPU, which would starve
them), as `recsys predict` runs its reader and writer threads beside its scoring threads.

    scripts/bench.sh ray [--users 100000] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
RECSYS = ROOT / "target" / "release" / "recsys"


def convert(kind: str, model_dir: str, out: Path) -> Path:
    src = FIXTURES / model_dir
    subprocess.run([str(RECSYS), "convert", "--force", "--kind", kind, "--checkpoint", str(src / "model.safetensors"),
                    "--config", str(src / "config.json"), "--item-map", str(src / "item_id_map.tsv"),
                    "--out", str(out)], check=True, capture_output=True)
    return out


def write_users(path: Path, users: int) -> None:
    """Fixture histories, then random suffixes of them: the lengths of a real user base."""
    rows = [line.split("\t") for line in (FIXTURES / "test_set.tsv").read_text().splitlines()[1:]]
    histories = [r[2].split() for r in rows]
    rng = random.Random(users)
    with path.open("w") as f:
        for user in range(users):
            history = histories[user % len(histories)]
            if user >= len(histories):
                history = history[rng.randrange(len(history)):] or history
            f.write(json.dumps({"user_id": user, "item_ids": [int(x) for x in history]}) + "\n")


def time_cli(engine: Path, users: Path, out: Path, threads: int) -> float:
    start = time.perf_counter()
    subprocess.run([str(RECSYS), "predict", "--engine", str(engine), "--input", str(users), "--output", str(out),
                    "--threads", str(threads)], check=True, capture_output=True)
    return time.perf_counter() - start


def time_ray(engine: Path, users: Path, out: Path, actors: int, batch_size: int) -> float:
    import ray.data

    import recsys.ray

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    # 20 blocks: the actors share the input evenly (one JSON file would make a handful).
    recsys.ray.predict(ray.data.read_json(str(users), override_num_blocks=20), engine, batch_size=batch_size,
                       concurrency=actors,
                       threads=1).write_json(str(out))
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=512, help="rows per engine batch in the Ray job")
    args = parser.parse_args()

    import ray

    import recsys  # noqa: F401  (fail before any timing when the package is missing)

    work = Path(tempfile.mkdtemp(prefix="bench_ray_"))
    try:
        users = work / "users.jsonl"
        write_users(users, args.users)
        engines = {"BERT4Rec": convert("bert4rec", "bert4rec", work / "bert4rec"),
                   "Mult-VAE": convert("vaecf", "multivae", work / "vaecf")}
        ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        # One warm-up job per engine: the first Ray job pays worker-process start-up once.
        for engine in engines.values():
            time_ray(engine, users, work / "warm", 1, args.batch_size)
        variants = [("recsys predict --threads 1", 1, lambda e: time_cli(e, users, work / "cli.jsonl", 1)),
                    ("recsys predict --threads 2", 2, lambda e: time_cli(e, users, work / "cli.jsonl", 2)),
                    ("recsys.ray.predict, 1 actor x 1 thread", 1,
                     lambda e: time_ray(e, users, work / "ray_out", 1, args.batch_size)),
                    ("recsys.ray.predict, 2 actors x 1 thread", 2,
                     lambda e: time_ray(e, users, work / "ray_out", 2, args.batch_size))]
        times = {(model, name): [] for model in engines for name, _, _ in variants}
        for _ in range(args.reps):
            for model, engine in engines.items():
                for name, _, run in variants:
                    times[(model, name)].append(run(engine))
        ray.shutdown()

        print(f"{args.users:,} users, JSON lines in and out, median of {args.reps}; ratio: against recsys "
              f"predict at the same number of scoring threads\n")
        print("| model | job | threads | users/s | vs recsys predict |")
        print("|---|---|---:|---:|---:|")
        for model in engines:
            cli = {threads: statistics.median(times[(model, name)])
                   for name, threads, _ in variants if name.startswith("recsys predict")}
            for name, threads, _ in variants:
                seconds = statistics.median(times[(model, name)])
                print(f"| {model} | {name} | {threads} | {args.users / seconds:,.0f} | "
                      f"{cli[threads] / seconds:.2f}x |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
