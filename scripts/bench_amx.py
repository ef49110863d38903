"""Engines on a CPU with AMX: their layers on AMX tiles against the SIMD kernels, the measured
AMX plan against both pinned, and the plain fp32 engine of the same model. Whole calls (encoder, output
layer, top-10 with the history excluded) through model_probe, which runs an engine as the server
does, with the plans this CPU measures for it.

    scripts/bench.sh amx [--variant bf16|screen|int8] [--threads 2] [--batches 1,8,64] [--rounds 3]
        [--reps 200]

--variant: which engine's tiles are timed: bf16 (its dense and output layers on AMX-BF16, the
default), screen (an fp32 engine converted with --screen int8: its exact screen's int8 scores on
AMX-INT8, the same answers as the plain fp32 engine) or int8 (weight-only int8: its output layer on
AMX-INT8).

Models: MovieLens-1M's shapes with random weights (Mult-VAE 3,416 items, 600-200-600; BERT4Rec
3,416 items, L = 200, 2 layers, hidden 64) on histories with MovieLens-1M's lengths, and the
Mult-VAE of MovieLens-20M's catalogue (20,108 items). Per model and batch size, four sides
alternate for --rounds rounds (best median of each): the variant's engine with its measured AMX
plan (`amx` auto), pinned on (tiles at every batch size), pinned off (the SIMD kernels), and the
plain fp32 engine. Every side runs its own measured bf16-path, row-block and thread plans, measured once
before the rounds into a fresh plan directory; the AMX plan's choice is printed with the table.
On a CPU without AMX there is nothing to time: the script says so and stops. This is an A/B of
recsys's own kernels; the peers (ONNX Runtime, OpenVINO f32 and its default, bf16 on AMX) are
`scripts/bench.sh models`, whose bf16 rows run with the AMX plan in force and whose header says
whether the CPU has AMX.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from bench_models import RECSYS, ml1m_bert4rec, ml1m_histories, random_multivae
from bench_threads import print_plans, probe
from cpu_info import cpu_model


# The convert flags of each variant's engine.
VARIANTS = {"bf16": ["--precision", "bf16"], "screen": ["--screen", "int8"], "int8": ["--precision", "int8"]}


def convert(kind: str, ckpt: Path, cfg: Path, item_map: Path, out: Path, *extra: str) -> None:
    subprocess.run([str(RECSYS), "convert", "--kind", kind, "--checkpoint", str(ckpt), "--config", str(cfg),
                    "--item-map", str(item_map), "--out", str(out), *extra], check=True, capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=200, help="calls per probe run (fewer at larger batches)")
    args = ap.parse_args()
    if "amx_tile" not in Path("/proc/cpuinfo").read_text():
        print(f"CPU: {cpu_model()} has no AMX: every engine runs its SIMD kernels, nothing to time")
        return
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(7)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = {**os.environ, "RECSYS_PLAN_DIR": str(tmp / "plans")}
        base.pop("RECSYS_PLAN", None)
        env = {policy: {**base, "RECSYS_PROBE_AMX": policy} for policy in ("auto", "on", "off")}
        models = []
        ckpt, cfg, item_map = ml1m_bert4rec(tmp, rng)
        ext = [int(line.split("\t")[1]) for line in item_map.read_text().splitlines()[1:]]
        models.append(("BERT4Rec (ML-1M shape)", "bert4rec", ckpt, cfg, item_map, ext))
        for n_items in (3416, 20108):
            _, ckpt, cfg, item_map, ext = random_multivae(tmp, rng, n_items)
            label = "Mult-VAE (ML-1M shape)" if n_items == 3416 else "Mult-VAE (ML-20M catalogue)"
            models.append((label, "vaecf", ckpt, cfg, item_map, ext))
        print(f"CPU: {cpu_model()}; {args.threads} threads; best median of {args.rounds} rounds; "
              f"variant {args.variant} ({' '.join(VARIANTS[args.variant])})\n")
        print("| model | batch | plan runs | planned ms | tiles ms | SIMD ms | fp32 ms "
              "| SIMD / tiles | SIMD / planned | fp32 / planned |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        plans = {}
        for label, kind, ckpt, cfg, item_map, ext in models:
            histories = tmp / f"{kind}-{len(ext)}-histories.json"
            histories.write_text(json.dumps(ml1m_histories(ext, rng)))
            fp32, engine = tmp / f"{kind}-{len(ext)}-fp32", tmp / f"{kind}-{len(ext)}-{args.variant}"
            convert(kind, ckpt, cfg, item_map, fp32)
            convert(kind, ckpt, cfg, item_map, engine, *VARIANTS[args.variant])
            # Measured once here, then read from their files by every run below.
            plans[label] = probe(engine, histories, 1, args.threads, 1, env["auto"])["plans"]
            for pinned in ("on", "off"):
                probe(engine, histories, 1, args.threads, 1, env[pinned])
            probe(fp32, histories, 1, args.threads, 1, base)
            chosen = next((p for p in plans[label] if p.startswith("amx:")), "")
            by_batch = [(int(b), runs) for b, runs in re.findall(r"batch (\d+)\+: (AMX tiles|SIMD tables)", chosen)]
            for batch in batches:
                reps = max(10, args.reps // max(1, batch // 4))
                sides = [("planned", engine, env["auto"]), ("tiles", engine, env["on"]),
                         ("simd", engine, env["off"]), ("fp32", fp32, base)]
                best = {side: float("inf") for side, _, _ in sides}
                for _ in range(args.rounds):
                    for side, side_engine, side_env in sides:
                        median = probe(side_engine, histories, batch, args.threads, reps, side_env)["median_s"]
                        best[side] = min(best[side], median)
                runs = next((r for b, r in reversed(by_batch) if b <= batch), "?")
                ms = {k: v * 1e3 for k, v in best.items()}
                print(f"| {label} | {batch} | {runs} | {ms['planned']:.3f} | {ms['tiles']:.3f} | "
                      f"{ms['simd']:.3f} | {ms['fp32']:.3f} | {ms['simd'] / ms['tiles']:.2f} | "
                      f"{ms['simd'] / ms['planned']:.2f} | {ms['fp32'] / ms['planned']:.2f} |", flush=True)
        print_plans(plans)


if __name__ == "__main__":
    main()
