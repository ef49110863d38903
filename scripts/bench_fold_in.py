"""How good fold-in's rows are: items cut out of each trained fixture model, folded back in from
their training interactions with `recsys catalogue fold-in`, against the rows the model trained.

    scripts/bench.sh fold-in [--cut-every 20] [--l2 0.1,1,10] [--k 10,50] [--out FILE.md]

For each family (BERT4Rec, SASRec, GRU4Rec, Mult-VAE; 2,000 items, 5,000 users, the fixtures'
synthetic data): every --cut-every-th item is removed from the trained checkpoint (every tensor
axis over the items loses it; the rest of the model is unchanged), the cut engine is converted,
and fold-in estimates the cut items' rows from the training interactions (each user's events but
the last two, the validation and test items). The held-out interactions are the validation and
test items that are cut items, each with the events before it as the history. HR@k is the share of
them in the top k of the whole catalogue (history excluded), answered by `recsys predict` on the
full engine (trained rows) and on the cut engine with the folded table (`--catalogue`); "ratio"
is folded over trained (the issue's target: at least 0.5). A cut engine alone can never return
them (HR 0).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from conftest import FIXTURES  # noqa: E402
from test_catalogue import N_ITEMS, cut_fixture  # noqa: E402
from cpu_info import cpu_model  # noqa: E402

FAMILIES = [("bert4rec", "bert4rec"), ("sasrec", "sasrec"), ("gru4rec", "gru4rec"), ("vaecf", "multivae")]
T0 = 1_600_000_000


def cases() -> list[tuple[str, int, list[int]]]:
    rows = [line.split("\t") for line in (FIXTURES / "test_set.tsv").read_text().splitlines()[1:]]
    return [(r[0], int(r[1]), [int(i) for i in r[2].split()]) for r in rows]


def run(*args: str) -> str:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"{args[:3]}: exit {done.returncode}\n{done.stderr}")
    return done.stdout


def answers(recsys: Path, engine: Path, requests: list[dict], k: int, tmp: Path, *extra: str) -> list[list[int]]:
    inputs = tmp / "requests.jsonl"
    inputs.write_text("".join(json.dumps(r) + "\n" for r in requests))
    out = run(recsys, "predict", "--engine", engine, "--input", inputs, "--output", "-", "--k", k, *extra)
    return [json.loads(line)["item_ids"] for line in out.splitlines()]


def measure(recsys: Path, engine: Path, new_cases: list[tuple[list[int], int]],
            old_cases: list[tuple[list[int], int]], cut_ids: set[int], ks: list[int], tmp: Path,
            *extra: str) -> dict[str, float]:
    """HR@k of the cut items' held-out interactions, each ranked against the engine's items with the
    other cut items left out (so a row is judged by how it ranks against the catalogue, not by
    how the new items rank against each other); HR@k of the other held-out interactions over the
    whole catalogue; and the share of those answers' top-k slots that cut items take."""
    k_max = max(ks)
    ranked = answers(recsys, engine, [{"item_ids": h, "exclude_item_ids": sorted(cut_ids - {t})}
                                      for h, t in new_cases], k_max, tmp, *extra)
    others = answers(recsys, engine, [{"item_ids": h} for h, _ in old_cases], k_max, tmp, *extra)
    result = {}
    for k in ks:
        result[f"new@{k}"] = sum(t in a[:k] for (_, t), a in zip(new_cases, ranked)) / len(new_cases)
        result[f"old@{k}"] = sum(t in a[:k] for (_, t), a in zip(old_cases, others)) / len(old_cases)
        result[f"crowd@{k}"] = sum(sum(i in cut_ids for i in a[:k]) for a in others) / (k * len(others))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cut-every", type=int, default=20)
    parser.add_argument("--l2", default="0.1,1,10")
    parser.add_argument("--k", default="10,50")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    recsys = ROOT / "target" / "release" / "recsys"
    ks = [int(k) for k in args.k.split(",")]
    penalties = [float(v) for v in args.l2.split(",")]
    cut = list(range(args.cut_every, N_ITEMS + 1, args.cut_every))
    map_lines = (FIXTURES / "sasrec" / "item_id_map.tsv").read_text().splitlines()[1:]
    external = {int(line.split("\t")[0]): int(line.split("\t")[1]) for line in map_lines}
    cut_ids = {external[i] for i in cut}
    users = cases()
    held_out: list[tuple[list[int], int]] = []
    others: list[tuple[list[int], int]] = []
    lines = ["user_id:token\titem_id:token\ttimestamp:float"]
    for user, target, history in users:
        for t, item in enumerate(history[:-1]):
            lines.append(f"{user}\t{item}\t{T0 + 3600 * t}")
        for case in ((history[:-1], history[-1]), (history, target)):
            (held_out if case[1] in cut_ids else others).append(case)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        train = tmp / "train.inter"
        train.write_text("\n".join(lines) + "\n")
        for kind, model_dir in FAMILIES:
            full = tmp / f"{kind}-full"
            src = FIXTURES / model_dir
            run(recsys, "convert", "--force", "--kind", kind, "--checkpoint", src / "model.safetensors",
                "--config", src / "config.json", "--item-map", src / "item_id_map.tsv", "--out", full)
            checkpoint, config, item_map = cut_fixture(model_dir, cut, tmp / f"{kind}-cut-checkpoint")
            cut_engine = tmp / f"{kind}-cut"
            run(recsys, "convert", "--force", "--kind", kind, "--checkpoint", checkpoint, "--config", config,
                "--item-map", item_map, "--out", cut_engine)
            trained = measure(recsys, full, held_out, others, cut_ids, ks, tmp)
            for l2 in penalties:
                table = tmp / f"{kind}-{l2}.parquet"
                report = json.loads(run(recsys, "catalogue", "fold-in", "--engine", cut_engine, "--interactions",
                                        train, "--output", table, "--l2", l2, "--json"))
                folded = measure(recsys, cut_engine, held_out, others, cut_ids, ks, tmp, "--catalogue", table)
                rows.append((kind, l2, report["items"], len(report["skipped"]), report["input_rows"], trained, folded))
                print(kind, l2, report["items"], trained, folded, flush=True)
    stamp = datetime.date.today().isoformat()
    out = [f"## {stamp} — fold-in: rows for new items from their first interactions, against the trained rows", "",
           f"CPU: {cpu_model()}. Fixture models (2,000 items, 5,000 users, synthetic data), every "
           f"{args.cut_every}th item cut ({len(cut)} items), folded in from the training interactions (each "
           f"user's events but the validation and test items). \"new\": the {len(held_out)} held-out "
           f"interactions (validation and test) with a cut item, HR@k of the item ranked against the "
           f"catalogue with the other cut items left out; \"others\": the {len(others)} other held-out "
           f"interactions, HR@k over the whole catalogue; \"crowd\": the share of those answers' top-k "
           f"slots the cut items take. trained: the full engine; folded: the cut engine with the fold-in "
           f"table. Command: `scripts/bench.sh fold-in --cut-every {args.cut_every} --l2 {args.l2} "
           f"--k {args.k}`.", ""]
    for k in ks:
        out += [f"| model | l2 | items folded (skipped) | input rows | new HR@{k} trained / folded | **ratio** | "
                f"others HR@{k} trained / folded | crowd@{k} trained / folded |",
                "|---|---|---|---|---|---|---|---|"]
        for kind, l2, items, skipped, source, trained, folded in rows:
            ratio = folded[f"new@{k}"] / trained[f"new@{k}"] if trained[f"new@{k}"] else float("nan")
            out.append(f"| {kind} | {l2:g} | {items} ({skipped}) | {source} | {trained[f'new@{k}']:.3f} / "
                       f"{folded[f'new@{k}']:.3f} | **{ratio:.2f}** | {trained[f'old@{k}']:.3f} / "
                       f"{folded[f'old@{k}']:.3f} | {trained[f'crowd@{k}']:.3f} / {folded[f'crowd@{k}']:.3f} |")
        out.append("")
    text = "\n".join(out) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
