"""HSTU against its peers: the official research module (Meta's generative-recommenders, eval mode,
PyTorch on the CPU) and ONNX Runtime and OpenVINO on the graph `recsys export-onnx` builds, at
MovieLens-1M's shape (the official "large" config: 8 blocks, D 50, 2 heads x (25 + 25)) and at
MovieLens-20M's (16 blocks, D 256, 8 heads x (32 + 32)), max_sequence_length 200, random weights,
batch 1 and 64, the same threads for everyone, fp32.

    scripts/bench.sh hstu [--threads 2] [--official-repo DIR] [--rounds N] [--out FILE.md] [--keep DIR]

Each side answers the same requests: a history (MovieLens-1M's length distribution, so some are
longer than the window and truncated to it) with a timestamp per event an hour apart, queried at
the next event's time; the top-10 of the whole catalogue with the history excluded.
recsys: `model_probe` (encode + fused score + top-k), the plain engine and the same model converted
with `--screen int8` (exact: its top-10 must equal the plain engine's), each with plans measured in
this run (a fresh `RECSYS_PLAN_DIR`: a plan kept from a busy moment would time another machine
state). ONNX Runtime / OpenVINO: the exported graph
(`item_seq`, `timestamps` with the query time after the last item, `exclude_ids`). The official
module: `HSTU.encode` on the official padded batch (ids and timestamps `[B, 211]`, the query time
at the slot after the history), then the user embeddings times the normalised item table (made
once, as recsys makes it at conversion), the history's items set to -inf and `torch.topk`: what a
team serving the research module would write. `--official-repo` points at a checkout of
github.com/meta-recsys/generative-recommenders (the research code at commit db1bf8f2e8f6 or
later); it needs torch, gin-config and fbgemm-gpu-cpu (for `torch.ops.fbgemm`), which
`scripts/bench.sh hstu` installs in .venv/hstu-peers. Sides alternate, two rounds (`--rounds`), each
keeping its best median.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import RECSYS, Peers, ml1m_histories, probe, write_safetensors  # noqa: E402
from bench_sequential import ML1M_ITEMS, hstu_weights  # noqa: E402
from cpu_info import cpu_model  # noqa: E402

K = 10
L = 200
OUTPUT_LENGTH = 10
T0 = 1_600_000_000
# (label, items, D, blocks, heads, dqk = dv)
SHAPES = [("ML-1M (large config)", ML1M_ITEMS, 50, 8, 2, 25), ("ML-20M", 26_744, 256, 16, 8, 32)]


def graph_feeds(histories: list[list[int]], index: dict[int, int]) -> dict[str, np.ndarray]:
    """The exported graph's inputs: the window right-padded with 0, each item's time then the query
    time after the last item, the history's items as exclusions."""
    mapped = [[index[x] for x in h] for h in histories]
    seq = np.zeros((len(mapped), L), np.int64)
    stamps = np.zeros((len(mapped), L + 1), np.int64)
    exclude = np.zeros((len(mapped), max(len(h) for h in mapped)), np.int64)
    for i, h in enumerate(mapped):
        start = max(len(h) - L, 0)
        window = h[start:]
        seq[i, :len(window)] = window
        stamps[i, :len(window) + 1] = [T0 + 3600 * p for p in range(start, len(h) + 1)]
        exclude[i, :len(h)] = h
    return {"item_seq": seq, "timestamps": stamps, "exclude_ids": exclude}


class Official:
    """The official research module with the benchmark's weights, answering as a team would."""

    def __init__(self, repo: Path, weights: dict[str, np.ndarray], n: int, d: int, blocks: int, heads: int,
                 width: int, threads: int):
        sys.path.insert(0, str(repo))
        import fbgemm_gpu  # noqa: F401,PLC0415  (registers torch.ops.fbgemm's CPU kernels)
        import gin  # noqa: PLC0415
        import torch  # noqa: PLC0415
        from generative_recommenders.research.modeling.sequential.embedding_modules import (  # noqa: PLC0415
            LocalEmbeddingModule)
        from generative_recommenders.research.modeling.sequential.encoder_utils import (  # noqa: PLC0415
            get_sequential_encoder)
        from generative_recommenders.research.modeling.sequential.input_features_preprocessors import (  # noqa: PLC0415
            LearnablePositionalEmbeddingInputFeaturesPreprocessor)
        from generative_recommenders.research.modeling.sequential.output_postprocessors import (  # noqa: PLC0415
            L2NormEmbeddingPostprocessor)
        from generative_recommenders.research.modeling.similarity_utils import (  # noqa: PLC0415
            get_similarity_function)

        self.torch = torch
        torch.set_num_threads(threads)
        gin.clear_config()
        gin.parse_config([f"hstu_encoder.num_blocks = {blocks}", f"hstu_encoder.num_heads = {heads}",
                          f"hstu_encoder.dqk = {width}", f"hstu_encoder.dv = {width}"])
        embedding = LocalEmbeddingModule(num_items=n, item_embedding_dim=d)
        interaction, _ = get_similarity_function(module_type="DotProduct", query_embedding_dim=d,
                                                 item_embedding_dim=d)
        self.model = get_sequential_encoder(
            module_type="HSTU", max_sequence_length=L, max_output_length=OUTPUT_LENGTH + 1,
            embedding_module=embedding, interaction_module=interaction,
            input_preproc_module=LearnablePositionalEmbeddingInputFeaturesPreprocessor(
                max_sequence_len=L + OUTPUT_LENGTH + 1, embedding_dim=d, dropout_rate=0.2),
            output_postproc_module=L2NormEmbeddingPostprocessor(embedding_dim=d, eps=1e-6), verbose=False)
        state = {k: torch.from_numpy(v.copy()) for k, v in weights.items()}
        # The causal mask is a buffer the module builds, not a weight.
        state["_attn_mask"] = self.model.state_dict()["_attn_mask"]
        # strict: every official weight comes from the benchmark's, none left at its init.
        self.model.load_state_dict(state, strict=True)
        self.model.eval()
        with torch.inference_mode():
            table = self.model._embedding_module._item_emb.weight[1:n + 1]
            self.table = table / torch.clamp(torch.linalg.norm(table, dim=-1, keepdim=True), min=1e-6)

    def feeds(self, histories: list[list[int]], index: dict[int, int]):
        torch = self.torch
        width = L + OUTPUT_LENGTH + 1
        ids = torch.zeros((len(histories), width), dtype=torch.int64)
        stamps = torch.zeros((len(histories), width), dtype=torch.int64)
        lengths = torch.zeros((len(histories),), dtype=torch.int64)
        seen = []
        for b, h in enumerate(histories):
            mapped = [index[x] for x in h]
            start = max(len(mapped) - L, 0)
            window = mapped[start:]
            ids[b, :len(window)] = torch.tensor(window)
            stamps[b, :len(window) + 1] = torch.tensor([T0 + 3600 * p for p in range(start, len(h) + 1)])
            lengths[b] = len(window)
            seen.append(torch.tensor([m - 1 for m in mapped]))
        rows = torch.cat([torch.full((len(s),), b) for b, s in enumerate(seen)])
        return lengths, ids, stamps, (rows, torch.cat(seen))

    def run(self, feeds):
        torch = self.torch
        lengths, ids, stamps, (rows, cols) = feeds
        with torch.inference_mode():
            user = self.model.encode(past_lengths=lengths, past_ids=ids,
                                     past_embeddings=self.model.get_item_embeddings(ids),
                                     past_payloads={"timestamps": stamps})
            scores = user @ self.table.T
            scores[rows, cols] = -math.inf
            return torch.topk(scores, K, dim=1).indices + 1


def timed(run, feeds_list, reps: int) -> float:
    run(feeds_list[0])
    times = []
    for r in range(reps):
        start = time.perf_counter()
        run(feeds_list[r % len(feeds_list)])
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--official-repo", type=Path,
                        help="a checkout of meta-recsys/generative-recommenders (without it: no official column)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternating rounds per cell, each side keeping its best median (default 2; more "
                             "where the machine has slow and fast phases of minutes)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="convert into DIR and leave there each shape's engine (engine-BLOCKS) and histories "
                             "(histories-BLOCKS.json), for model_probe runs of one's own")
    args = parser.parse_args()
    import onnx  # noqa: PLC0415

    rows = []
    with tempfile.TemporaryDirectory() as scratch, tempfile.TemporaryDirectory() as plans:
        os.environ["RECSYS_PLAN_DIR"] = plans
        tmp = Path(scratch)
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = args.keep
        for label, n, d, blocks, heads, width in SHAPES:
            rng = np.random.default_rng(59)
            weights, cfg = hstu_weights(n, d, blocks, heads, width, width, L, rng, OUTPUT_LENGTH)
            ckpt, cfg_path, map_path = tmp / "hstu.safetensors", tmp / "hstu.json", tmp / "map.tsv"
            write_safetensors(ckpt, weights)
            cfg_path.write_text(json.dumps(cfg))
            map_path.write_text("internal_index\texternal_item_id\n"
                                + "".join(f"{i + 1}\t{2_000_001 + i}\n" for i in range(n)))
            engine = tmp / f"engine-{blocks}"
            subprocess.run([str(RECSYS), "convert", "--force", "--kind", "hstu", "--checkpoint", str(ckpt), "--config",
                            str(cfg_path), "--item-map", str(map_path), "--out", str(engine)],
                           check=True, capture_output=True)
            # The same model with the exact int8 screen: fp32 answers, bit for bit, the catalogue scan
            # reading a quarter of the bytes where the engine's plan measures it faster.
            screened = tmp / f"engine-{blocks}-screened"
            subprocess.run([str(RECSYS), "convert", "--force", "--kind", "hstu", "--checkpoint", str(ckpt), "--config",
                            str(cfg_path), "--item-map", str(map_path), "--out", str(screened), "--screen", "int8"],
                           check=True, capture_output=True)
            graph = tmp / f"hstu-{blocks}.onnx"
            subprocess.run([str(RECSYS), "export-onnx", "--force", "--engine", str(engine), "--out", str(graph), "--k", str(K)],
                           check=True, capture_output=True)
            index = {2_000_001 + i: i + 1 for i in range(n)}
            histories = ml1m_histories(sorted(index), rng, count=640)
            (tmp / f"histories-{blocks}.json").write_text(json.dumps(histories))
            peers = Peers(onnx.load(str(graph)), args.threads)
            official = None
            if args.official_repo:
                official = Official(args.official_repo, weights, n, d, blocks, heads, width, args.threads)
            for batch, reps in [(1, 60), (64, 6)]:
                chunks = [histories[i * batch:(i + 1) * batch] for i in range(max(reps, 1))
                          if (i + 1) * batch <= len(histories)]
                feeds = [graph_feeds(c, index) for c in chunks]
                official_feeds = [official.feeds(c, index) for c in chunks] if official else []
                best: dict[str, float] = {}
                ours = None
                for _ in range(max(args.rounds, 1)):
                    run = probe(engine, histories, batch, args.threads, reps, tmp)
                    if ours is None or run["median_s"] < ours["median_s"]:
                        ours = run
                    run = probe(screened, histories, batch, args.threads, reps, tmp)
                    if run["top_first"] != ours["top_first"]:
                        raise SystemExit(f"{label} batch {batch}: the screened engine answered otherwise")
                    best["screened"] = min(best.get("screened", math.inf), run["median_s"])
                    for name, runner in peers.runners.items():
                        best[name] = min(best.get(name, math.inf), timed(runner, feeds, reps))
                    if official:
                        best["official"] = min(best.get("official", math.inf),
                                               timed(official.run, official_feeds, reps))
                # Agreement on the first history's top-10 (recsys's ids are external).
                want = [x - 2_000_000 for x in ours["top_first"][:K]] if "top_first" in ours else None
                agree = {}
                if want is not None:
                    first = graph_feeds(histories[:1], index)
                    agree["ORT"] = len(set(want) & set(peers.runners["ORT"](first)[0].tolist())) / K
                    if official:
                        got = official.run(official.feeds(histories[:1], index))[0].tolist()
                        agree["official"] = len(set(want) & set(got)) / K
                screened_s = best.pop("screened")
                rows.append((label, n, batch, ours["median_s"], screened_s, best, agree))
                print(label, batch, ours["median_s"], best, agree, flush=True)
    peer_names = [p for p in ["official", "ORT", "OV f32", "OV default"] if p in rows[0][5]]
    lines = [
        f"{datetime.date.today().isoformat()}, CPU (lscpu): {cpu_model()}; {args.threads} threads for everyone; "
        "HSTU fp32, random weights, max_sequence_length 200; top-10 of the whole catalogue with the history "
        f"excluded; each side's best median of {max(args.rounds, 1)} alternating rounds",
        "",
        "| shape | items | batch | recsys ms | recsys + exact screen ms | "
        + " | ".join(f"{p} ms | {p} / recsys (screened)" for p in peer_names)
        + " | top-10 agreement, first history |",
        "|---|---|---|---|---|" + "---|---|" * len(peer_names) + "---|",
    ]
    for label, n, batch, ours_s, screened_s, best, agree in rows:
        cells = " | ".join(f"{1000 * best[p]:.3f} | **{best[p] / ours_s:.2f}** ({best[p] / screened_s:.2f})"
                           for p in peer_names)
        agreement = ", ".join(f"{k} {v:.1f}" for k, v in agree.items()) or "-"
        lines.append(f"| {label} | {n} | {batch} | {1000 * ours_s:.3f} | {1000 * screened_s:.3f} | {cells} | {agreement} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
