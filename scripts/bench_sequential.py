"""SASRec and GRU4Rec against ONNX Runtime and OpenVINO, same weights and histories, same
invocation, same threads; each model also as a `--precision bf16` engine (rows marked "bf16"),
whose column to read is OpenVINO's default precision (bf16 where the CPU has it).

    scripts/bench.sh sequential [--threads 2] [--out FILE.md]

recsys: `model_probe` (the engine: encode + fused score + top-k with the history excluded).
Peers: each model as `torch.onnx.export` writes it from RecBole's module, built here with
onnx.helper from the same weights. SASRec: the padded sequence (the last L items, left-aligned)
through every layer at every position, RecBole's additive mask (-10000 on PAD keys and on keys
after the query), the last item's row gathered, the tied output layer, TopK. GRU4Rec: the item
embedding, the ONNX `GRU` operator over the padded sequence (`linear_before_reset = 1`, as PyTorch
exports `nn.GRU`), the dense layer at every slot, the last item's row, the output layer, TopK. The
exclusion of the history is an additive -inf mask input. That one ONNX model runs in ONNX Runtime,
in OpenVINO with f32 inference forced and in OpenVINO at its default precision, each with one
stream and the same threads; peer timings cover inference only. recsys and the peers alternate for
two rounds; each side keeps its best median. Batch-1 rows also give recsys on one thread.

Models: the trained fixtures (N = 2000, L = 50) and MovieLens-1M's shapes with random weights
(3,416 items; SASRec hidden 64, 2 layers, 2 heads, inner 256, max_len 200; GRU4Rec embedding 64,
hidden 128, 1 layer, max_len 200), on histories with MovieLens-1M's lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from bench_models import (FIX, K, RECSYS, Graph, alternating, ml1m_histories, one_thread, peers_table,
                          probe, read_safetensors, transformer_layers, write_safetensors)

ML1M_ITEMS = 3416


def last_row(g: Graph, x: str, width: int) -> str:
    """The last item's row of `x` ([B, L, width]) by the `last_onehot` input ([B, L])."""
    axes = g.const(np.array([1], dtype=np.int64))
    picked = g.op("MatMul", g.op("Unsqueeze", "last_onehot", axes), x)
    return g.op("Reshape", picked, g.const(np.array([0, width], dtype=np.int64)))


def scores_and_session(g: Graph, h: str, table: np.ndarray, n_out: int, seq_len: int, threads: int):
    logits = g.op("Add", g.op("MatMul", h, g.const(np.ascontiguousarray(table[:n_out].T))), "exclude")
    inputs = [helper.make_tensor_value_info("item_seq", TensorProto.INT64, ["B", seq_len]),
              helper.make_tensor_value_info("last_onehot", TensorProto.FLOAT, ["B", seq_len]),
              helper.make_tensor_value_info("exclude", TensorProto.FLOAT, ["B", n_out])]
    return g.session(inputs, logits, threads)


def sasrec_session(w, cfg, threads):
    H, L, n_out = cfg["hidden_size"], cfg["max_seq_length"], cfg["n_real_items"] + 1
    g = Graph()
    x = g.op("Add", g.op("Gather", g.const(w["item_embedding.weight"]), "item_seq"), g.const(w["position_embedding.weight"]))
    x = g.ln(x, w["LayerNorm.weight"], w["LayerNorm.bias"], 1e-12)
    # RecBole's extended mask: (key is an item) and (key <= query), else -10000; [B, 1, L, L].
    is_item = g.op("Not", g.op("Equal", "item_seq", g.const(np.int64(0))))
    causal = g.const(np.tril(np.ones((L, L), dtype=bool)))
    keys = g.op("Unsqueeze", is_item, g.const(np.array([1, 2], dtype=np.int64)))
    allowed = g.op("And", keys, causal)
    mask = g.op("Where", allowed, g.const(np.float32(0.0)), g.const(np.float32(-10000.0)))
    x = transformer_layers(g, w, cfg, x, mask, 1e-12)
    return scores_and_session(g, last_row(g, x, H), w["item_embedding.weight"], n_out, L, threads)


def gru_gates_onnx_order(m: np.ndarray, hidden: int) -> np.ndarray:
    """PyTorch's (reset, update, new) rows as ONNX's (update, reset, new)."""
    r, z, n = m[:hidden], m[hidden:2 * hidden], m[2 * hidden:]
    return np.concatenate([z, r, n])


def gru4rec_session(w, cfg, threads):
    E, G, L, n_out = cfg["embedding_size"], cfg["hidden_size"], cfg["max_seq_length"], cfg["n_real_items"] + 1
    g = Graph()
    x = g.op("Transpose", g.op("Gather", g.const(w["item_embedding.weight"]), "item_seq"), perm=[1, 0, 2])
    for l in range(cfg["num_layers"]):
        wi = gru_gates_onnx_order(w[f"gru_layers.weight_ih_l{l}"], G)[None]
        wh = gru_gates_onnx_order(w[f"gru_layers.weight_hh_l{l}"], G)[None]
        bias = np.zeros((1, 6 * G), dtype=np.float32)
        y = g.op("GRU", x, g.const(wi), g.const(wh), g.const(bias), hidden_size=G, linear_before_reset=1)
        x = g.op("Squeeze", y, g.const(np.array([1], dtype=np.int64)))
    x = g.op("Transpose", x, perm=[1, 0, 2])
    # RecBole applies the dense layer at every slot, then gathers the last item's.
    dense = g.linear(x, w["dense.weight"], w["dense.bias"])
    return scores_and_session(g, last_row(g, dense, E), w["item_embedding.weight"], n_out, L, threads)


def feeds(batch_hist: list[list[int]], ext_to_int: dict, L: int, N: int) -> dict:
    """The last L items, left-aligned; the last item's slot as a one-hot; PAD and the history
    excluded."""
    seq = np.zeros((len(batch_hist), L), dtype=np.int64)
    onehot = np.zeros((len(batch_hist), L), dtype=np.float32)
    excl = np.zeros((len(batch_hist), N + 1), dtype=np.float32)
    for i, h in enumerate(batch_hist):
        ids = [ext_to_int[x] for x in h]
        tail = ids[-L:]
        seq[i, : len(tail)] = tail
        onehot[i, len(tail) - 1] = 1.0
        excl[i, 0] = -np.inf
        excl[i, ids] = -np.inf
    return {"item_seq": seq, "last_onehot": onehot, "exclude": excl}


def hstu_weights(n: int, d: int, blocks: int, heads: int, dqk: int, dv: int, L: int, rng,
                 output_length: int = 10, buckets: int = 128) -> tuple[dict, dict]:
    """An HSTU with random weights under the official research code's state-dict names, and its
    config (the official hyper-parameter names): `n` items of width `d`, `blocks` blocks of
    `heads` heads, a window of `L` items."""
    normal = lambda *shape: (rng.standard_normal(shape, dtype=np.float32) * 0.05)  # noqa: E731
    na = L + output_length + 1
    w = {"_embedding_module._item_emb.weight": normal(n + 1, d),
         "_input_features_preproc._pos_emb.weight": normal(na, d)}
    for b in range(blocks):
        p = f"_hstu._attention_layers.{b}."
        w[p + "_uvqk"] = normal(d, 2 * heads * (dqk + dv))
        w[p + "_o.weight"] = normal(d, heads * dv)
        w[p + "_o.bias"] = normal(d)
        w[p + "_rel_attn_bias._ts_w"] = normal(buckets + 1)
        w[p + "_rel_attn_bias._pos_w"] = normal(2 * na - 1)
    cfg = {"main_module": "HSTU", "num_items": n, "max_sequence_length": L, "item_embedding_dim": d,
           "num_blocks": blocks, "num_heads": heads, "dqk": dqk, "dv": dv, "gr_output_length": output_length,
           "item_l2_norm": True}
    return w, cfg


def ml1m_model(kind: str, tmp: Path, rng) -> tuple[Path, Path, Path]:
    """A SASRec, GRU4Rec or HSTU of MovieLens-1M's shape with random weights: checkpoint, config,
    item map (HSTU: the official "large" ML-1M config, 8 blocks of 2 heads, D 50)."""
    n, L = ML1M_ITEMS, 200
    normal = lambda *shape: (rng.standard_normal(shape, dtype=np.float32) * 0.05)  # noqa: E731
    if kind == "hstu":
        w, cfg = hstu_weights(n, 50, 8, 2, 25, 25, L, rng)
    elif kind == "sasrec":
        h, inner = 64, 256
        w = {"item_embedding.weight": normal(n + 1, h), "position_embedding.weight": normal(L, h),
             "LayerNorm.weight": np.ones(h, np.float32), "LayerNorm.bias": np.zeros(h, np.float32)}
        for l in range(2):
            p = f"trm_encoder.layer.{l}."
            for m in ["query", "key", "value", "dense"]:
                w[p + f"multi_head_attention.{m}.weight"] = normal(h, h)
                w[p + f"multi_head_attention.{m}.bias"] = normal(h)
            for ln in ["multi_head_attention.LayerNorm", "feed_forward.LayerNorm"]:
                w[p + ln + ".weight"] = np.ones(h, np.float32)
                w[p + ln + ".bias"] = np.zeros(h, np.float32)
            w[p + "feed_forward.dense_1.weight"] = normal(inner, h)
            w[p + "feed_forward.dense_1.bias"] = normal(inner)
            w[p + "feed_forward.dense_2.weight"] = normal(h, inner)
            w[p + "feed_forward.dense_2.bias"] = normal(h)
        cfg = {"n_real_items": n, "max_seq_length": L, "n_layers": 2, "n_heads": 2, "hidden_size": h,
               "inner_size": inner, "layer_norm_eps": 1e-12}
    else:
        e, hidden = 64, 128
        w = {"item_embedding.weight": normal(n + 1, e), "gru_layers.weight_ih_l0": normal(3 * hidden, e),
             "gru_layers.weight_hh_l0": normal(3 * hidden, hidden), "dense.weight": normal(e, hidden),
             "dense.bias": normal(e)}
        cfg = {"n_real_items": n, "max_seq_length": L, "embedding_size": e, "hidden_size": hidden, "num_layers": 1}
    ckpt, cfg_path, item_map = tmp / f"ml1m_{kind}.safetensors", tmp / f"ml1m_{kind}.json", tmp / "ml1m_map.tsv"
    write_safetensors(ckpt, w)
    cfg_path.write_text(json.dumps(cfg))
    item_map.write_text("internal_index\texternal_item_id\n" + "".join(f"{i + 1}\t{2_000_001 + i}\n" for i in range(n)))
    return ckpt, cfg_path, item_map


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    threads = args.threads
    rows = []
    ov_default = "-"
    test = [l.split("\t") for l in (FIX / "test_set.tsv").read_text().splitlines()[1:]]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # Plans measured by this run's build, on this run's engines: plan files are keyed by the
        # package version and the engine's weights, so the user's plan cache may hold plans an
        # earlier build measured for the same random weights.
        os.environ.setdefault("RECSYS_PLAN_DIR", str(tmp / "plans"))
        rng = np.random.default_rng(33)
        for kind, label in [("sasrec", "SASRec"), ("gru4rec", "GRU4Rec")]:
            specs = [(f"{label} (fixture)", FIX / kind / "model.safetensors", FIX / kind / "config.json",
                      FIX / kind / "item_id_map.tsv", None),
                     (f"{label} (ML-1M shape, random weights)", *ml1m_model(kind, tmp, rng), "ml1m")]
            for row_label, ckpt, cfg_path, map_path, synthetic in specs:
                cfg = json.loads(cfg_path.read_text())
                w = read_safetensors(ckpt)
                if kind == "gru4rec" and "gru_layers.bias_ih_l0" in w:
                    raise SystemExit("the peer graph here assumes RecBole's bias-free GRU")
                engine = tmp / f"{kind}_{synthetic or 'fixture'}"
                engine_bf16 = tmp / f"{kind}_{synthetic or 'fixture'}_bf16"
                for out, extra in [(engine, []), (engine_bf16, ["--precision", "bf16"])]:
                    subprocess.run([str(RECSYS), "convert", "--kind", kind, "--checkpoint", str(ckpt),
                                    "--config", str(cfg_path), "--item-map", str(map_path), "--out", str(out),
                                    *extra], check=True, capture_output=True)
                ext_to_int = {int(l.split("\t")[1]): int(l.split("\t")[0]) for l in map_path.read_text().splitlines()[1:]}
                if synthetic:
                    histories = ml1m_histories(sorted(ext_to_int), rng)
                else:
                    histories = [[int(x) for x in t[2].split()] for t in test[:640]]
                L, N = cfg["max_seq_length"], cfg["n_real_items"]
                sess = (sasrec_session if kind == "sasrec" else gru4rec_session)(w, cfg, threads)
                ov_default = sess.ov_default_precision
                int_to_ext = {v: k for k, v in ext_to_int.items()}
                for batch in [1, 64]:
                    batches = [feeds(histories[i * batch:(i + 1) * batch], ext_to_int, L, N)
                               for i in range(max(1, min(10, len(histories) // batch)))]
                    reps = (300 if batch == 1 else 30) // (3 if synthetic else 1)
                    ours, theirs = alternating(lambda: probe(engine, histories, batch, threads, reps, tmp), sess,
                                               batches, reps)
                    ort_top = sess.runners["ORT"](batches[0])[0].tolist()
                    agree = len(set(ours["top_first"]) & {int_to_ext[i] for i in ort_top}) / K
                    rows.append((row_label, N, batch, ours["median_s"], theirs, agree,
                                 one_thread(engine, histories, batch, reps)))
                    # The bf16 engine against the same peers (its column to compare: OpenVINO's
                    # default, bf16 on CPUs with AVX512-BF16 or AMX; the AMX plan in force).
                    ours = min((probe(engine_bf16, histories, batch, threads, reps, tmp) for _ in range(2)),
                               key=lambda o: o["median_s"])
                    agree = len(set(ours["top_first"]) & {int_to_ext[i] for i in ort_top}) / K
                    rows.append((row_label.replace(")", ", bf16)"), N, batch, ours["median_s"], theirs, agree,
                                 one_thread(engine_bf16, histories, batch, reps)))

    lines = peers_table(rows, threads, ours["isa"], ov_default)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
