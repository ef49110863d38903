"""The thread plan against every batch on all its threads, and against one thread: whole calls of
the four fixture models (encoder, output layer, top-10 with the history excluded) through
model_probe, which runs an engine as the server does, with the plans this CPU measures for it.

    scripts/bench.sh threads [--threads 2] [--batches 1,8,64] [--rounds 3] [--reps 200]

Per model and batch size, three sides alternate for --rounds rounds (best median of each):
`--threads N` with the measured thread plan, `--threads N` with every batch on all N threads
(RECSYS_PLAN=off: what an engine without a plan does) and one thread. The plan is measured once,
before the rounds, into a fresh plan directory, and its choice is printed with the table.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from cpu_info import cpu_model

ROOT = Path(__file__).resolve().parent.parent
RECSYS = ROOT / "target" / "release" / "recsys"
PROBE = ROOT / "target" / "release" / "model_probe"
FIXTURES = ROOT / "tests" / "fixtures"


def convert(kind: str, out: Path, *extra: str) -> None:
    """Converts fixture model `kind` into engine `out` (`extra`: more `recsys convert` flags)."""
    if kind in ("sasrec", "gru4rec"):
        args = ["--checkpoint", FIXTURES / kind / "recbole_checkpoint.pth", "--item-map",
                FIXTURES / kind / "item_id_map.tsv"]
    else:
        src = "multivae" if kind == "vaecf" else kind
        args = ["--kind", kind, "--checkpoint", FIXTURES / src / "model.safetensors",
                "--config", FIXTURES / src / "config.json", "--item-map", FIXTURES / src / "item_id_map.tsv"]
    subprocess.run([RECSYS, "convert", "--force", *map(str, args), *extra, "--output", str(out)],
                   check=True, capture_output=True)


def probe(engine: Path, histories: Path, batch: int, threads: int, reps: int, env: dict) -> dict:
    out = subprocess.run([str(PROBE), str(engine), str(histories), str(batch), "10", str(threads), str(reps)],
                         check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout)


def print_plans(plans: dict[str, list[str]]) -> None:
    """Each model's plans as model_probe described them, one list item each."""
    print()
    for model, lines in plans.items():
        for line in lines:
            print(f"- {model}: {line}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=200, help="calls per probe run (fewer at batch 64)")
    ap.add_argument("--models", default="vaecf,bert4rec,sasrec,gru4rec")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = [line.split("\t") for line in (FIXTURES / "test_set.tsv").read_text().splitlines()[1:]]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        histories = tmp / "histories.json"
        histories.write_text(json.dumps([[int(x) for x in r[2].split()] for r in rows]))
        planned = {**os.environ, "RECSYS_PLAN_DIR": str(tmp / "plans")}
        planned.pop("RECSYS_PLAN", None)
        every_thread = {**planned, "RECSYS_PLAN": "off"}
        print(f"CPU: {cpu_model()}; {args.threads} threads; best median of {args.rounds} rounds\n")
        print(f"| model | batch | planned threads | planned ms | all {args.threads} threads ms | all / planned "
              f"| 1 thread ms | 1 thread / planned |")
        print("|---|---|---|---|---|---|---|---|")
        plans = {}
        for model in args.models.split(","):
            engine = tmp / model
            convert(model, engine)
            # Measured once here, then read from its file by every run below.
            plans[model] = probe(engine, histories, 1, args.threads, 1, planned)["plans"]
            for batch in batches:
                reps = max(20, args.reps // max(1, batch // 8))
                best = {"planned": float("inf"), "all": float("inf"), "one": float("inf")}
                for _ in range(args.rounds):
                    for side, threads, env in [("planned", args.threads, planned), ("all", args.threads, every_thread),
                                               ("one", 1, every_thread)]:
                        best[side] = min(best[side], probe(engine, histories, batch, threads, reps, env)["median_s"])
                chosen = next((p for p in plans[model] if p.startswith("threads:")), "")
                by_batch = [(int(b), t) for b, t in re.findall(r"batch (\d+)\+: (\d+) thread", chosen)]
                threads_for = next((t for b, t in reversed(by_batch) if b <= batch), "?")
                ms = {k: v * 1e3 for k, v in best.items()}
                print(f"| {model} | {batch} | {threads_for} | {ms['planned']:.3f} | {ms['all']:.3f} | "
                      f"{ms['all'] / ms['planned']:.2f} | {ms['one']:.3f} | {ms['one'] / ms['planned']:.2f} |")
        print_plans(plans)


if __name__ == "__main__":
    main()
