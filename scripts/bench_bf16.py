"""bf16 engines on a CPU with AVX512-BF16: the per-batch kernel plan against either path pinned,
and against the fp32 engine of the same model. Whole calls of the four fixture models (encoder,
output layer, top-10 with the history excluded) through model_probe, which runs an engine as the
server does, with the plans this CPU measures for it.

    scripts/bench.sh bf16 [--threads 2] [--batches 1,8,64] [--rounds 3] [--reps 200]

Per model and batch size, four sides alternate for --rounds rounds (best median of each): the
bf16 engine with its measured plan (`bf16_path` auto), pinned to `vdpbf16ps` (native), pinned to
the widened path, and the fp32 engine. Every side runs its own measured row-block and thread
plans; the plans are measured once, before the rounds, into a fresh plan directory, and the bf16
plan's choice is printed with the table. On a CPU without AVX512-BF16 there is nothing to plan:
the script says so and stops.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from pathlib import Path

from bench_threads import FIXTURES, convert, print_plans, probe
from cpu_info import cpu_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=200, help="calls per probe run (fewer at batch 64)")
    ap.add_argument("--models", default="vaecf,bert4rec,sasrec,gru4rec")
    args = ap.parse_args()
    if "avx512_bf16" not in Path("/proc/cpuinfo").read_text():
        print(f"CPU: {cpu_model()} has no AVX512-BF16: a bf16 engine runs widened, nothing to plan")
        return
    batches = [int(b) for b in args.batches.split(",")]
    rows = [line.split("\t") for line in (FIXTURES / "test_set.tsv").read_text().splitlines()[1:]]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        histories = tmp / "histories.json"
        histories.write_text(json.dumps([[int(x) for x in r[2].split()] for r in rows]))
        base = {**os.environ, "RECSYS_PLAN_DIR": str(tmp / "plans")}
        base.pop("RECSYS_PLAN", None)
        env = {path: {**base, "RECSYS_PROBE_BF16_PATH": path} for path in ("auto", "native", "widened")}
        print(f"CPU: {cpu_model()}; {args.threads} threads; best median of {args.rounds} rounds\n")
        print("| model | batch | plan runs | planned ms | native ms | widened ms | fp32 ms "
              "| faster pinned / planned | fp32 / planned |")
        print("|---|---|---|---|---|---|---|---|---|")
        plans = {}
        for model in args.models.split(","):
            fp32, bf16 = tmp / f"{model}-fp32", tmp / f"{model}-bf16"
            convert(model, fp32)
            convert(model, bf16, "--precision", "bf16")
            # Measured once here, then read from their files by every run below.
            plans[model] = probe(bf16, histories, 1, args.threads, 1, env["auto"])["plans"]
            for pinned in ("native", "widened"):
                probe(bf16, histories, 1, args.threads, 1, env[pinned])
            probe(fp32, histories, 1, args.threads, 1, base)
            chosen = next((p for p in plans[model] if p.startswith("kernels:")), "")
            by_batch = [(int(b), path) for b, path in re.findall(r"batch (\d+)\+: (vdpbf16ps|widened)", chosen)]
            for batch in batches:
                reps = max(20, args.reps // max(1, batch // 8))
                sides = [("planned", bf16, env["auto"]), ("native", bf16, env["native"]),
                         ("widened", bf16, env["widened"]), ("fp32", fp32, base)]
                best = {side: float("inf") for side, _, _ in sides}
                for _ in range(args.rounds):
                    for side, engine, side_env in sides:
                        best[side] = min(best[side],
                                         probe(engine, histories, batch, args.threads, reps, side_env)["median_s"])
                runs = next((p for b, p in reversed(by_batch) if b <= batch), "?")
                ms = {k: v * 1e3 for k, v in best.items()}
                faster_pinned = min(ms["native"], ms["widened"])
                print(f"| {model} | {batch} | {runs} | {ms['planned']:.3f} | {ms['native']:.3f} | "
                      f"{ms['widened']:.3f} | {ms['fp32']:.3f} | {faster_pinned / ms['planned']:.2f} | "
                      f"{ms['fp32'] / ms['planned']:.2f} |")
        print_plans(plans)


if __name__ == "__main__":
    main()
