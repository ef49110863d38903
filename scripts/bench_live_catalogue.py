"""What a live catalogue costs: an engine answering with a catalogue delta against the same
catalogue compiled into the engine, per request, and what putting a delta in force costs.

    scripts/bench.sh live-catalogue [--items 1000000] [--shares 0.01,0.1] [--threads 1]
                                    [--batches 1,64] [--reps 300] [--rounds 3] [--out FILE.md]

The model is BERT4Rec with the fixture's trained encoder and a random item table of --items rows
(no trained table of that size is available here; the cost does not depend on the values), as
scripts/bench_catalogue.py builds it. For each share s of the catalogue:

- compiled: the engine converted with every item;
- added: the engine converted without the last s x items, given them back as a delta published by
  `recsys catalogue publish` (their rows as `recsys export-items --with-input-rows` wrote them for
  the compiled engine): the same catalogue;
- retired: the compiled engine with a delta retiring s x items: every request then carries the
  mask of the items still offered (compared with the compiled engine answering the same requests).

Timed by model_probe (the engine in-process: encoder + fused score + top-k, k = 10, random
histories of 5-100 items), each variant in its own process, alternating in --rounds rounds; the
table gives medians of the per-round medians and the ratio to the compiled engine in the same
round, and the time the probe took to put the delta in force (`Engine::with_catalogue`: what a
server's swap costs, off the serving path).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_catalogue import FIRST_ID, read_safetensors, write_safetensors  # noqa: E402
from bench_catalogue import checkpoints as synthetic_checkpoint  # noqa: E402
from cpu_info import cpu_model  # noqa: E402

RECSYS = ROOT / "target" / "release" / "recsys"
PROBE = ROOT / "target" / "release" / "model_probe"
K = 10


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True, timeout=3600, **kw)


def convert(ckpt: Path, cfg: Path, item_map: Path, out: Path) -> None:
    run([RECSYS, "convert", "--kind", "bert4rec", "--checkpoint", ckpt, "--config", cfg, "--item-map", item_map,
         "--out", out, "--force"])


def cut(ckpt: Path, cfg: Path, item_map: Path, kept: int, tmp: Path) -> tuple[Path, Path, Path]:
    """The checkpoint with only its first `kept` items (BERT4Rec's mask row stays last)."""
    w = read_safetensors(ckpt)
    table = w["item_embedding.weight"]
    w["item_embedding.weight"] = np.concatenate([table[: kept + 1], table[-1:]])
    w["output_bias"] = w["output_bias"][: kept + 1]
    out_ckpt, out_cfg, out_map = tmp / f"cut{kept}.safetensors", tmp / f"cut{kept}.json", tmp / f"cut{kept}.tsv"
    write_safetensors(out_ckpt, w)
    config = json.loads(cfg.read_text())
    config["n_real_items"] = kept
    out_cfg.write_text(json.dumps(config))
    out_map.write_text("".join(line + "\n" for line in item_map.read_text().splitlines()[:kept]))
    return out_ckpt, out_cfg, out_map


def publish(engine: Path, table: Path, tmp: Path, name: str) -> Path:
    """`recsys catalogue publish` of `table` for `engine` in a repository of its own: the object."""
    repo = tmp / f"repo-{name}"
    (repo / "m").mkdir(parents=True)
    (repo / "m" / "1").symlink_to(engine.resolve())
    (repo / "m" / "config.pbtxt").write_text('backend: "recsys"\n')
    run([RECSYS, "catalogue", "publish", "--repository", repo, "--model", "m", table])
    return repo / "m" / "recsys-catalogue.bin"


def probe(engine: Path, histories: Path, batch: int, threads: int, reps: int, catalogue: Path | None) -> dict:
    env = dict(os.environ, RECSYS_PLAN="off")
    if catalogue is not None:
        env["RECSYS_PROBE_CATALOGUE"] = str(catalogue)
    out = run([PROBE, engine, histories, batch, K, threads, reps], env=env)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--shares", default="0.01,0.1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    shares = [float(s) for s in args.shares.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="recsys-live-catalogue-") as tmp_name:
        tmp = Path(tmp_name)
        print(f"building a {args.items}-item BERT4Rec ...", file=sys.stderr)
        ckpt, cfg, item_map = synthetic_checkpoint("bert4rec", args.items, tmp)
        compiled = tmp / "compiled"
        convert(ckpt, cfg, item_map, compiled)
        run([RECSYS, "export-items", "--engine", compiled, "--output", tmp / "items", "--format", "parquet",
             "--with-input-rows"])
        table = pq.read_table(tmp / "items.parquet")
        rng = np.random.default_rng(3)
        histories = tmp / "histories.json"
        histories.write_text(json.dumps(
            [[FIRST_ID + 1 + int(j) for j in rng.choice(args.items, size=int(rng.integers(5, 101)), replace=False)]
             for _ in range(256)]))
        variants: dict[str, tuple[Path, Path | None]] = {"compiled": (compiled, None)}
        for share in shares:
            moved = int(round(share * args.items))
            kept = args.items - moved
            print(f"delta of {moved} items ({share:.0%}) ...", file=sys.stderr)
            c_ckpt, c_cfg, c_map = cut(ckpt, cfg, item_map, kept, tmp)
            engine = tmp / f"cut-{moved}"
            convert(c_ckpt, c_cfg, c_map, engine)
            added = tmp / f"added-{moved}.parquet"
            pq.write_table(table.slice(kept, moved), added)
            variants[f"added {share:.0%}"] = (engine, publish(engine, added, tmp, f"added-{moved}"))
            retired_ids = rng.choice(args.items, size=moved, replace=False) + FIRST_ID + 1
            retire = tmp / f"retired-{moved}.parquet"
            pq.write_table(pa.table({"item_id": pa.array(retired_ids, pa.int64()),
                                     "vector": pa.array([None] * moved, pa.list_(pa.float32())),
                                     "op": ["retire"] * moved}), retire)
            variants[f"retired {share:.0%}"] = (compiled, publish(compiled, retire, tmp, f"retired-{moved}"))

        rows = []
        for batch in batches:
            per_round: dict[str, list[float]] = {name: [] for name in variants}
            ratios: dict[str, list[float]] = {name: [] for name in variants}
            apply_s: dict[str, float] = {}
            reps = max(20, args.reps // batch) if batch > 1 else args.reps
            for _ in range(args.rounds):
                base = None
                for name, (engine, catalogue) in variants.items():
                    out = probe(engine, histories, batch, args.threads, reps, catalogue)
                    assert out["items"] == args.items, out
                    per_round[name].append(out["median_s"])
                    if out["catalogue_apply_s"] is not None:
                        apply_s[name] = out["catalogue_apply_s"]
                    if name == "compiled":
                        base = out["median_s"]
                    ratios[name].append(out["median_s"] / base)
            for name in variants:
                rows.append((batch, name, statistics.median(per_round[name]) * 1e3,
                             statistics.median(ratios[name]), apply_s.get(name)))

    cpu = cpu_model()
    lines = [
        f"### {datetime.date.today().isoformat()}: a live catalogue against the catalogue compiled in "
        f"({args.items} items, BERT4Rec d = 64)",
        "",
        f"CPU: {cpu}; {args.threads} thread(s); k = {K}; median of {args.rounds} alternating rounds of "
        f"model_probe medians. Command: `scripts/bench.sh live-catalogue --items {args.items} "
        f"--shares {args.shares} --threads {args.threads} --batches {args.batches}`",
        "",
        "| batch | engine | ms per batch | vs compiled | delta put in force (s) |",
        "|---|---|---|---|---|",
    ]
    for batch, name, ms, ratio, applied in rows:
        applied_text = "-" if applied is None else f"{applied:.2f}"
        lines.append(f"| {batch} | {name} | {ms:.3f} | {ratio:.3f}x | {applied_text} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
