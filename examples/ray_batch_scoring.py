"""Nightly batch scoring of a user base on Ray: users in (JSON lines or Parquet, one row per user
with "user_id" and "item_ids", oldest first), recommendations out (the same format), through an
actor pool that loads the recsys engine once per actor.

    # a local cluster on this machine (one CPU is left for reading and writing)
    .venv/bin/python examples/ray_batch_scoring.py --engine model_repository/bert4rec/1 \\
        --input users.jsonl --output recommendations/ --k 10

    # an existing cluster (RAY_ADDRESS or --address): the engine directory must be at the same
    # path on every node (shared storage, or copied there first); actors per node = cores / threads
    .venv/bin/python examples/ray_batch_scoring.py --address auto --actors 16 --threads 2 ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import ray
import ray.data

import recsys.ray


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, help="an engine directory written by `recsys convert`")
    parser.add_argument("--input", required=True, help="a .jsonl/.json or .parquet file or folder of them")
    parser.add_argument("--output", required=True, help="the folder the recommendations are written to")
    parser.add_argument("--format", choices=["json", "parquet"], help="output format (default: the input's)")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--actors", type=int, help="actors in the pool (default: the cluster's CPUs / threads, less one CPU)")
    parser.add_argument("--threads", type=int, default=1, help="scoring threads (and CPUs) per actor")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--address", help="a running Ray cluster (default: RAY_ADDRESS, else a local one)")
    parser.add_argument("--local-cpus", type=int, help="CPUs of the local cluster (default: this machine's)")
    args = parser.parse_args()

    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=args.local_cpus, include_dashboard=False)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    actors = args.actors or max((cpus - 1) // args.threads, 1)

    is_parquet = args.input.endswith(".parquet") or (
        os.path.isdir(args.input) and any(f.endswith(".parquet") for f in os.listdir(args.input)))
    users = ray.data.read_parquet(args.input) if is_parquet else ray.data.read_json(args.input)
    out_format = args.format or ("parquet" if is_parquet else "json")

    started = time.perf_counter()
    scored = recsys.ray.predict(users, args.engine, k=args.k, batch_size=args.batch_size,
                                concurrency=actors, threads=args.threads)
    if out_format == "parquet":
        scored.write_parquet(args.output)
    else:
        # 15 significant digits: float32 scores survive the trip through JSON exactly.
        scored.write_json(args.output, double_precision=15)
    seconds = time.perf_counter() - started

    # The written rows, counted from the output itself: how many were answered and refused.
    written = ray.data.read_parquet(args.output) if out_format == "parquet" else ray.data.read_json(args.output)
    total = written.count()
    refused = written.filter(lambda row: row["error"] is not None).count()
    print(f"{total} users scored by {actors} actor(s) x {args.threads} thread(s) in {seconds:.1f} s "
          f"({total / seconds:,.0f} users/s); {refused} refused (see their \"error\"); output in {args.output}")
    return 0 if refused == 0 else 3


if __name__ == "__main__":
    sys.exit(main())
