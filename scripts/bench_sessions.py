"""Growing sessions: the per-event latency of a user's history coming back one event longer on every
call, recsys with its prefix cache against recsys without it, and against ONNX Runtime and OpenVINO
recomputing the history (the only way they can: the model as RecBole's module exports it).

    scripts/bench.sh sessions [--model gru4rec|sasrec|both] [--threads 2] [--out FILE.md]

Models at MovieLens-1M's shapes with random weights (`bench_sequential.py`'s): GRU4Rec (3,416
items, embedding 64, hidden 128, 1 layer, max_len 200), SASRec (3,416 items, hidden 64, 2
layers of 2 heads, inner 256, max_len 200) and HSTU (`--model hstu`: the official "large" ML-1M
config, 3,416 items, D 50, 8 blocks of 2 heads x (25 + 25), max_sequence_length 200; events an
hour apart, each call at the next event's time; its peers run the graph `recsys export-onnx` builds),
on histories of at least 200 distinct items. Each
call carries every history of a group of `batch` users, one event longer than the last call
(batch 1, and 64 concurrent users); the table gives the median latency of the call that brings the
histories to 10, 50, 100 and 200 events (encode + score + top-10 with the history excluded).
recsys: `session_probe` with the cache on and off, the whole call and the encoder alone (the part
the cache can shorten; the output layer's scan and top-k cost the same either way). Peers: the
history up to that event, padded to L as RecBole's exported module takes it; they run alternately
with recsys, the same threads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_models import RECSYS, ml1m_histories
from bench_sequential import feeds, gru4rec_session, ml1m_model, sasrec_session
from bench_models import read_safetensors
from cpu_info import cpu_model

ROOT = Path(__file__).resolve().parents[1]
SESSION_PROBE = ROOT / "target" / "release" / "session_probe"
LENGTHS = [10, 50, 100, 200]


def recsys_side(engine: Path, histories: Path, batch: int, threads: int, cache: bool, groups: int,
                encoder_only: bool = False) -> dict:
    run = subprocess.run([str(SESSION_PROBE), str(engine), str(histories), str(batch), "10", str(threads),
                          "on" if cache else "off", str(groups), ",".join(map(str, LENGTHS))]
                         + (["encode"] if encoder_only else []),
                         check=True, capture_output=True, text=True, timeout=1800)
    return json.loads(run.stdout)


def peer_side(sess, prefixes: dict[int, list[dict]], reps: int) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for name, runner in sess.runners.items():
        out[name] = {}
        for length, batches in prefixes.items():
            times = []
            for _ in range(reps):
                for f in batches:
                    start = time.perf_counter()
                    runner(f)
                    times.append(time.perf_counter() - start)
            out[name][length] = float(np.median(times))
    return out


def measure_model(kind: str, threads: int, tmp: Path) -> list[tuple[int, dict]]:
    rng = np.random.default_rng(44)
    ckpt, cfg_path, map_path = ml1m_model(kind, tmp, rng)
    cfg = json.loads(cfg_path.read_text())
    engine = tmp / kind
    subprocess.run([str(RECSYS), "convert", "--kind", kind, "--checkpoint", str(ckpt), "--config",
                    str(cfg_path), "--item-map", str(map_path), "--out", str(engine)], check=True, capture_output=True)
    ext_to_int = {int(l.split("\t")[1]): int(l.split("\t")[0]) for l in map_path.read_text().splitlines()[1:]}
    histories = [h for h in ml1m_histories(sorted(ext_to_int), rng, count=4000) if len(h) >= max(LENGTHS)]
    path = tmp / f"{kind}-histories.json"
    path.write_text(json.dumps(histories))
    L = cfg.get("max_seq_length", cfg.get("max_sequence_length"))
    N = cfg.get("n_real_items", cfg.get("num_items"))
    if kind == "hstu":
        # The peers run the graph recsys exports (timestamps as session_probe gives them: an
        # hour apart, each prefix asked at the next event's time).
        import onnx  # noqa: PLC0415
        from bench_hstu import graph_feeds  # noqa: PLC0415
        from bench_models import Peers  # noqa: PLC0415

        graph = tmp / "hstu.onnx"
        subprocess.run([str(RECSYS), "export-onnx", "--engine", str(engine), "--out", str(graph), "--k", "10"],
                       check=True, capture_output=True)
        sess = Peers(onnx.load(str(graph)), threads)

        def batch_feeds(batch_hist):
            return graph_feeds(batch_hist, ext_to_int)
    else:
        sess = (sasrec_session if kind == "sasrec" else gru4rec_session)(read_safetensors(ckpt), cfg, threads)

        def batch_feeds(batch_hist):
            return feeds(batch_hist, ext_to_int, L, N)
    rows = []
    for batch, groups in [(1, 24), (64, 2)]:
        prefixes = {t: [batch_feeds([h[:t] for h in histories[g * batch:(g + 1) * batch]])
                        for g in range(min(groups, 4))] for t in LENGTHS}
        best: dict = {}
        for _ in range(2):  # sides alternating; each keeps its best median
            for encoder_only in (False, True):
                for cache in (True, False):
                    r = recsys_side(engine, path, batch, threads, cache, groups, encoder_only)
                    times = {p["length"]: p["median_s"] for p in r["per_event"]}
                    key = ("enc_" if encoder_only else "") + ("on" if cache else "off")
                    best[key] = times if key not in best else {t: min(best[key][t], times[t]) for t in times}
                    if cache and not encoder_only:
                        best["stats"] = r["cache_stats"]
                        best["isa"] = r["isa"]
            peers = peer_side(sess, prefixes, 30 if batch == 1 else 3)
            for name, times in peers.items():
                best[name] = times if name not in best else {t: min(best[name][t], times[t]) for t in times}
        rows.append((batch, best))
    return rows


def table(kind: str, threads: int, rows: list[tuple[int, dict]]) -> str:
    label = {"gru4rec": "GRU4Rec", "sasrec": "SASRec", "hstu": "HSTU"}[kind]
    peer_names = [n for n in rows[0][1] if n not in ("on", "off", "enc_on", "enc_off", "stats", "isa")]
    lines = [
        f"{label}: {datetime.date.today().isoformat()}, CPU (lscpu): {cpu_model()}; {threads} threads for every "
        f"side; recsys {rows[0][1]['isa']} kernels; {label} at MovieLens-1M's shapes, random weights; median "
        "latency of the call that brings every history of the batch to that many events",
        "",
        "| batch | events | recsys cache on ms | recsys cache off ms | off / on | encoder on ms | encoder off ms | "
        "encoder off / on |" + "".join(f" {n} ms | {n} / recsys on |" for n in peer_names),
        "|---|---|---|---|---|---|---|---|" + "---|---|" * len(peer_names),
    ]
    for batch, best in rows:
        for t in LENGTHS:
            on, off = best["on"][t], best["off"][t]
            enc_on, enc_off = best["enc_on"][t], best["enc_off"][t]
            peer_cells = "".join(f" {best[n][t] * 1e3:.3f} | {best[n][t] / on:.2f} |" for n in peer_names)
            lines.append(f"| {batch} | {t} | {on * 1e3:.3f} | {off * 1e3:.3f} | {off / on:.2f} | {enc_on * 1e3:.3f} | "
                         f"{enc_off * 1e3:.3f} | {enc_off / enc_on:.2f} |{peer_cells}")
    stats = rows[0][1]["stats"]
    lines += ["", f"Cache memory per cached user (batch 1 run, {max(LENGTHS)} events): {stats['bytes_per_entry']} "
                  f"bytes ({stats['entries']} entries, {stats['bytes']} bytes; events computed "
                  f"{stats['events_computed']}, reused {stats['events_reused']})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gru4rec", "sasrec", "hstu", "both"], default="both")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    kinds = ["gru4rec", "sasrec"] if args.model == "both" else [args.model]
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            tables.append(table(kind, args.threads, measure_model(kind, args.threads, Path(tmp))))
            print(tables[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(tables))


if __name__ == "__main__":
    main()
