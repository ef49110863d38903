"""Whole models against ONNX Runtime and OpenVINO, same weights and histories, same invocation,
same threads.

    scripts/bench.sh models [--threads 2] [--out FILE.md]

recsys: `model_probe` (the engine: encode + fused score + top-k with the history excluded).
Peers: the model as a user exports it from PyTorch, built here with onnx.helper from the same
weights: BERT4Rec over the padded sequence with the attention mask, every position through every
layer, then the [MASK] row, the tied output layer and TopK; Mult-VAE on the dense multi-hot input
(F.normalize, encoder, mu, decoder) and TopK. The exclusion of the history is an additive -inf
mask input. That one ONNX model runs in ONNX Runtime, in OpenVINO with f32 inference forced
(`INFERENCE_PRECISION_HINT=f32`) and in OpenVINO at its default precision (bf16 on CPUs with
AVX512-BF16 or AMX), each with one stream and the same threads. Peer timings cover inference only
(input preparation is not counted, which favours the peers). recsys and the peers alternate for
two rounds; each side keeps its best median. Batch-1 rows also give recsys on one thread: the
engine picks its threads by the work (a pool worker is woken ahead only for an output layer worth
splitting), so its 2-thread time must not lose to that.

Models: the fixture BERT4Rec and Mult-VAE (N = 2000, trained); MovieLens-1M's shapes with random
weights (BERT4Rec: 3,416 items, max_len 200, 2 layers, 2 heads, hidden 64, inner 256; Mult-VAE:
3,416 items, 600-200-600), on histories with MovieLens-1M's lengths (log-normal, median 96, mean
165, at least 20); a Mult-VAE with MovieLens-20M's catalogue (20,108 items) on the same kind of
histories; and a Mult-VAE with N = 100,000 items and random weights. The small-catalogue
Mult-VAEs also run as `--screen int8` engines (rows marked "screened"): the exact screen, so the
fp32 engine's answers, from a quarter of the output layer's bytes (timed against the same peer runs).
Every model also runs as a `--precision bf16` engine (rows marked "bf16"), whose column to read is
OpenVINO's default precision: both round weights and activations to bf16.

Roofline table: model_probe reports the thread-seconds each batch spent in dense layers, attention
and the output layer (`recsys_engine::profile`); this script counts each kind's multiply-adds for
the very batches the probe ran (from the model's shapes and each history's length) and sets the
achieved GFLOP/s per busy core against one core's FMA peak, and the output layer's bytes read per
busy second against one core's read bandwidth, both measured in the same run (kernel_probe).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from cpu_info import cpu_model

try:  # OpenVINO: the peer many CPU teams pick (scripts/python-env.sh --peers installs it)
    import openvino as ov
except ImportError:  # pragma: no cover - the table then has ONNX Runtime alone
    ov = None

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures"
RECSYS = ROOT / "target" / "release" / "recsys"
PROBE = ROOT / "target" / "release" / "model_probe"
KERNEL_PROBE = ROOT / "target" / "release" / "kernel_probe"
K = 10


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        assert meta["dtype"] == "F32", meta
        s, e = meta["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + s : 8 + n + e], dtype=np.float32).reshape(meta["shape"])
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        b = np.ascontiguousarray(t, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


class Graph:
    def __init__(self):
        self.nodes, self.inits, self.n = [], [], 0

    def const(self, value, name=None) -> str:
        name = name or f"c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type, *inputs, **attrs) -> str:
        self.n += 1
        out = f"t{self.n}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def linear(self, x, w, b) -> str:
        return self.op("Add", self.op("MatMul", x, self.const(np.ascontiguousarray(w.T))), self.const(b))

    def gelu(self, x) -> str:
        erf = self.op("Erf", self.op("Div", x, self.const(np.float32(math.sqrt(2.0)))))
        return self.op("Mul", self.op("Mul", x, self.op("Add", erf, self.const(np.float32(1.0)))), self.const(np.float32(0.5)))

    def ln(self, x, w, b, eps) -> str:
        return self.op("LayerNormalization", x, self.const(w), self.const(b), axis=-1, epsilon=eps)

    def session(self, inputs, output, threads) -> "Peers":
        topk_vals, topk_idx = "VALUES", "INDICES"
        self.nodes.append(helper.make_node("TopK", [output, self.const(np.array([K], dtype=np.int64))], [topk_vals, topk_idx], axis=1))
        graph = helper.make_graph(self.nodes, "model", inputs,
                                  [helper.make_tensor_value_info(topk_vals, TensorProto.FLOAT, None),
                                   helper.make_tensor_value_info(topk_idx, TensorProto.INT64, None)], self.inits)
        return Peers(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), threads)


class Peers:
    """One exported model in every peer runtime, each on `threads` threads: ONNX Runtime, OpenVINO
    with f32 inference forced, and OpenVINO at its default precision (bf16 where the CPU has it).
    Each runner takes the feeds and returns the TopK indices."""

    def __init__(self, model, threads: int):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        self.runners = {"ORT": lambda feeds: sess.run(None, feeds)[1]}
        self.ov_default_precision = "-"
        if ov is None:
            return
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model.onnx"
            path.write_bytes(model.SerializeToString())
            core = ov.Core()
            read = core.read_model(str(path))
            base = {"INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
            f32 = core.compile_model(read, "CPU", {**base, "INFERENCE_PRECISION_HINT": "f32"})
            default = core.compile_model(read, "CPU", base)
        self.ov_default_precision = str(default.get_property("INFERENCE_PRECISION_HINT"))
        for name, compiled in [("OV f32", f32), ("OV default", default)]:
            request = compiled.create_infer_request()
            self.runners[name] = lambda feeds, r=request: r.infer(feeds)[1]


def transformer_layers(g: "Graph", w, cfg, x: str, mask: str, eps: float) -> str:
    """RecBole's post-LN `TransformerEncoder` (BERT4Rec's and SASRec's) over every position of `x`,
    the additive `mask` ([B, 1, L or 1, L]) on the attention scores."""
    H, heads = cfg["hidden_size"], cfg["n_heads"]
    dh = H // heads
    split = g.const(np.array([0, 0, heads, dh], dtype=np.int64))
    merge = g.const(np.array([0, 0, H], dtype=np.int64))
    for l in range(cfg["n_layers"]):
        p = f"trm_encoder.layer.{l}."
        a = p + "multi_head_attention."
        heads_of = lambda t, perm: g.op("Transpose", g.op("Reshape", t, split), perm=perm)  # noqa: E731
        q = heads_of(g.linear(x, w[a + "query.weight"], w[a + "query.bias"]), [0, 2, 1, 3])
        k = heads_of(g.linear(x, w[a + "key.weight"], w[a + "key.bias"]), [0, 2, 3, 1])
        v = heads_of(g.linear(x, w[a + "value.weight"], w[a + "value.bias"]), [0, 2, 1, 3])
        s = g.op("Add", g.op("Div", g.op("MatMul", q, k), g.const(np.float32(math.sqrt(dh)))), mask)
        c = g.op("Reshape", g.op("Transpose", g.op("MatMul", g.op("Softmax", s, axis=-1), v), perm=[0, 2, 1, 3]), merge)
        x = g.ln(g.op("Add", g.linear(c, w[a + "dense.weight"], w[a + "dense.bias"]), x),
                 w[a + "LayerNorm.weight"], w[a + "LayerNorm.bias"], eps)
        f = p + "feed_forward."
        inner = g.gelu(g.linear(x, w[f + "dense_1.weight"], w[f + "dense_1.bias"]))
        x = g.ln(g.op("Add", g.linear(inner, w[f + "dense_2.weight"], w[f + "dense_2.bias"]), x),
                 w[f + "LayerNorm.weight"], w[f + "LayerNorm.bias"], eps)
    return x


def bert4rec_session(w, cfg, threads):
    H, L = cfg["hidden_size"], cfg["max_seq_length"]
    eps, n_out = cfg["layer_norm_eps"], cfg["n_real_items"] + 1
    g = Graph()
    x = g.op("Add", g.op("Gather", g.const(w["item_embedding.weight"]), "item_seq"), g.const(w["position_embedding.weight"]))
    x = g.ln(x, w["LayerNorm.weight"], w["LayerNorm.bias"], eps)
    pad = g.op("Cast", g.op("Equal", "item_seq", g.const(np.int64(0))), to=TensorProto.FLOAT)
    mask = g.op("Unsqueeze", g.op("Mul", pad, g.const(np.float32(-10000.0))), g.const(np.array([1, 2], dtype=np.int64)))
    x = transformer_layers(g, w, cfg, x, mask, eps)
    h = g.op("Reshape", g.op("MatMul", g.op("Unsqueeze", "mask_onehot", g.const(np.array([1], dtype=np.int64))), x),
             g.const(np.array([0, H], dtype=np.int64)))
    h = g.ln(g.gelu(g.linear(h, w["output_ffn.weight"], w["output_ffn.bias"])), w["output_ln.weight"], w["output_ln.bias"], eps)
    logits = g.op("Add", g.linear(h, w["item_embedding.weight"][:n_out], w["output_bias"]), "exclude")
    inputs = [helper.make_tensor_value_info("item_seq", TensorProto.INT64, ["B", L]),
              helper.make_tensor_value_info("mask_onehot", TensorProto.FLOAT, ["B", L]),
              helper.make_tensor_value_info("exclude", TensorProto.FLOAT, ["B", n_out])]
    return g.session(inputs, logits, threads)


def vaecf_session(w, n_out, latent, threads):
    g = Graph()
    norm = g.op("Max", g.op("ReduceL2", "multihot", axes=[1], keepdims=1), g.const(np.float32(1e-12)))
    x = g.op("Div", "multihot", norm)
    h = g.op("Tanh", g.linear(x, w["encoder.0.weight"], w["encoder.0.bias"]))
    e = g.linear(h, w["encoder.2.weight"], w["encoder.2.bias"])
    mu = g.op("Slice", e, g.const(np.array([0], dtype=np.int64)), g.const(np.array([latent], dtype=np.int64)),
              g.const(np.array([1], dtype=np.int64)))
    z = g.op("Tanh", g.linear(mu, w["decoder.0.weight"], w["decoder.0.bias"]))
    logits = g.op("Add", g.linear(z, w["decoder.2.weight"], w["decoder.2.bias"]), "exclude")
    inputs = [helper.make_tensor_value_info("multihot", TensorProto.FLOAT, ["B", n_out]),
              helper.make_tensor_value_info("exclude", TensorProto.FLOAT, ["B", n_out])]
    return g.session(inputs, logits, threads)


def bert4rec_feeds(batch_hist: list[list[int]], ext_to_int: dict, L: int, N: int) -> dict:
    """Inputs of `bert4rec_session` for histories of external ids: the last L-1 items and [MASK],
    the MASK slot as a one-hot, PAD and the history excluded."""
    seq = np.zeros((len(batch_hist), L), dtype=np.int64)
    onehot = np.zeros((len(batch_hist), L), dtype=np.float32)
    excl = np.zeros((len(batch_hist), N + 1), dtype=np.float32)
    for i, h in enumerate(batch_hist):
        ids = [ext_to_int[x] for x in h][-(L - 1):]
        seq[i, : len(ids)] = ids
        seq[i, len(ids)] = N + 1
        onehot[i, len(ids)] = 1.0
        excl[i, 0] = -np.inf
        excl[i, [ext_to_int[x] for x in h]] = -np.inf
    return {"item_seq": seq, "mask_onehot": onehot, "exclude": excl}


def vaecf_feeds(batch_hist: list[list[int]], index: dict, n_items: int) -> dict:
    """Inputs of `vaecf_session`: the multi-hot of each history, PAD and the history excluded."""
    x = np.zeros((len(batch_hist), n_items + 1), dtype=np.float32)
    excl = np.zeros_like(x)
    for i, h in enumerate(batch_hist):
        idx = [index[e] for e in h]
        x[i, idx] = 1.0
        excl[i, idx] = -np.inf
        excl[i, 0] = -np.inf
    return {"multihot": x, "exclude": excl}


def probe(engine: Path, histories: list[list[int]], batch: int, threads: int, reps: int, tmp: Path) -> dict:
    path = tmp / "histories.json"
    path.write_text(json.dumps(histories))
    out = subprocess.run([str(PROBE), str(engine), str(path), str(batch), str(K), str(threads), str(reps)],
                         check=True, capture_output=True, text=True, timeout=1200)
    return json.loads(out.stdout)


def one_thread(engine: Path, histories: list[list[int]], batch: int, reps: int) -> float | None:
    """Batch 1 only: recsys on one thread (its best median of two runs), against which the
    threads-by-work-size rule is judged: more threads must never lose to one."""
    if batch != 1:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        return min(probe(engine, histories, batch, 1, reps, Path(tmp))["median_s"] for _ in range(2))


def probe_batches(n_histories: int, batch: int, reps: int) -> list[list[int]]:
    """The history indices of each timed batch, as model_probe builds them."""
    return [[(r * batch + i) % n_histories for i in range(batch)] for r in range(max(reps, 1))]


def bert4rec_work(cfg: dict, lengths: list[int], batches: list[list[int]]) -> dict[str, float]:
    """Multiply-adds per batch by kind (mean over `batches`), as the engine runs BERT4Rec: the
    history's last L-1 items plus [MASK], every layer over every token except the last, which runs
    its query, attention output and feed-forward for the [MASK] row only."""
    h, inner, layers = cfg["hidden_size"], cfg["inner_size"], cfg["n_layers"]
    n_out, L = cfg["n_real_items"] + 1, cfg["max_seq_length"]
    totals = {"dense": 0.0, "attention": 0.0, "output": 0.0}
    for b in batches:
        for u in b:
            t = min(lengths[u], L - 1) + 1
            full = t * (4 * h * h + 2 * h * inner)
            totals["dense"] += (layers - 1) * full + t * 2 * h * h + (2 * h * h + 2 * h * inner) + h * h
            totals["attention"] += (layers - 1) * 2 * t * t * h + 2 * t * h
            totals["output"] += n_out * h
    return {k: v / len(batches) for k, v in totals.items()}


def vaecf_work(n_out: int, hidden: int, latent: int, distinct: list[int], batches: list[list[int]]) -> dict[str, float]:
    """Multiply-adds per batch by kind for Mult-VAE (the first layer's gather-sum counted as one
    add per weight read, in dense)."""
    totals = {"dense": 0.0, "attention": 0.0, "output": 0.0}
    for b in batches:
        for u in b:
            totals["dense"] += distinct[u] * hidden + 2 * hidden * latent
            totals["output"] += n_out * hidden
    return {k: v / len(batches) for k, v in totals.items()}


def ml1m_bert4rec(tmp: Path, rng) -> tuple[Path, Path, Path]:
    """A BERT4Rec of MovieLens-1M's shape as RecBole trains it there (3,416 items, max_len 200,
    2 layers, 2 heads, hidden 64, inner 256) with random weights: checkpoint, config, item map."""
    n, h, inner, L = 3416, 64, 256, 200
    normal = lambda *shape: (rng.standard_normal(shape, dtype=np.float32) * 0.02)  # noqa: E731
    w = {"item_embedding.weight": normal(n + 2, h), "position_embedding.weight": normal(L, h),
         "LayerNorm.weight": np.ones(h, np.float32), "LayerNorm.bias": np.zeros(h, np.float32),
         "output_ffn.weight": normal(h, h), "output_ffn.bias": normal(h),
         "output_ln.weight": np.ones(h, np.float32), "output_ln.bias": np.zeros(h, np.float32),
         "output_bias": normal(n + 1)}
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
    ckpt, cfg, item_map = tmp / "ml1m_bert4rec.safetensors", tmp / "ml1m_bert4rec.json", tmp / "ml1m_map.tsv"
    write_safetensors(ckpt, w)
    cfg.write_text(json.dumps({"n_real_items": n, "max_seq_length": L, "n_layers": 2, "n_heads": 2,
                               "hidden_size": h, "inner_size": inner, "layer_norm_eps": 1e-12}))
    item_map.write_text("internal_index\texternal_item_id\n" + "".join(f"{i + 1}\t{2_000_001 + i}\n" for i in range(n)))
    return ckpt, cfg, item_map


def random_multivae(tmp: Path, rng, n_items: int):
    """A Mult-VAE as RecBole builds it with latent_dimension 400 (items -> 600 -> 200 mu -> 600 ->
    items) with random weights: its weights, checkpoint, config, item map and external ids."""
    w = {
        "encoder.0.weight": rng.standard_normal((600, n_items + 1), dtype=np.float32) * 0.02,
        "encoder.0.bias": rng.standard_normal(600, dtype=np.float32) * 0.02,
        "encoder.2.weight": rng.standard_normal((400, 600), dtype=np.float32) * 0.05,
        "encoder.2.bias": rng.standard_normal(400, dtype=np.float32) * 0.02,
        "decoder.0.weight": rng.standard_normal((600, 200), dtype=np.float32) * 0.05,
        "decoder.0.bias": rng.standard_normal(600, dtype=np.float32) * 0.02,
        "decoder.2.weight": rng.standard_normal((n_items + 1, 600), dtype=np.float32) * 0.05,
        "decoder.2.bias": rng.standard_normal(n_items + 1, dtype=np.float32) * 0.02,
    }
    ckpt, cfg_path, map_path = tmp / f"vae{n_items}.safetensors", tmp / f"vae{n_items}.json", tmp / f"vae{n_items}_map.tsv"
    write_safetensors(ckpt, w)
    cfg_path.write_text(json.dumps({"n_real_items": n_items, "mlp_hidden_size": [600], "latent_dimension": 400}))
    ext_ids = list(range(1_000_001, 1_000_001 + n_items))
    map_path.write_text("internal_index\texternal_item_id\n" + "".join(f"{i + 1}\t{e}\n" for i, e in enumerate(ext_ids)))
    return w, ckpt, cfg_path, map_path, ext_ids


def ml1m_histories(ext_ids: list[int], rng, count: int = 640) -> list[list[int]]:
    """Histories with MovieLens-1M's lengths: at least 20 ratings per user, median 96, mean 165
    (a log-normal with those moments), of distinct items."""
    lengths = np.clip(np.round(rng.lognormal(math.log(96), 1.04, count)), 20, len(ext_ids) - 1).astype(int)
    return [[ext_ids[j] for j in rng.choice(len(ext_ids), size=int(t), replace=False)] for t in lengths]


def machine_peaks() -> tuple[float, float]:
    """One core's FMA peak (FLOP/s) and read bandwidth (bytes/s), from kernel_probe."""
    fma = json.loads(subprocess.run([str(KERNEL_PROBE), "fma", "1"], check=True, capture_output=True, text=True).stdout)
    bw = json.loads(subprocess.run([str(KERNEL_PROBE), "bandwidth", "512", "1", "3"], check=True, capture_output=True,
                                   text=True).stdout)
    return fma["flops"], bw["bytes_per_s"]


def roofline_row(label: str, n: int, batch: int, ours: dict, work: dict, output_bytes: int, peaks) -> str:
    fma, bandwidth = peaks
    cells = []
    for kind in ("dense", "attention", "output"):
        seconds = ours["thread_seconds"][kind]
        if work[kind] == 0 or seconds == 0:
            cells.append("-")
            continue
        gflops = 2 * work[kind] / seconds / 1e9
        cells.append(f"{gflops:.1f} ({100 * gflops * 1e9 / fma:.0f} %)")
    out_s = ours["thread_seconds"]["output"]
    gbs = output_bytes / out_s / 1e9 if out_s else 0.0
    busy = sum(ours["thread_seconds"].values())
    return (f"| {label} | {n} | {batch} | {' | '.join(cells)} | {gbs:.1f} ({100 * gbs * 1e9 / bandwidth:.0f} %) | "
            f"{1000 * busy:.3f} | {1000 * ours['mean_s']:.3f} |")


def time_peer(run, feeds_list, reps):
    run(feeds_list[0])
    times = []
    for r in range(reps):
        feeds = feeds_list[r % len(feeds_list)]
        start = time.perf_counter()
        run(feeds)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def time_peers(peers: Peers, feeds_list, reps) -> dict[str, float]:
    return {name: time_peer(run, feeds_list, reps) for name, run in peers.runners.items()}


def alternating(ours_once, peers: Peers, feeds_list, reps, rounds: int = 2):
    """recsys and every peer, sides alternating for `rounds` rounds; each side's best median (the
    machine's noise only ever adds time)."""
    ours, theirs = None, {}
    for _ in range(rounds):
        run = ours_once()
        if ours is None or run["median_s"] < ours["median_s"]:
            ours = run
        for name, t in time_peers(peers, feeds_list, reps).items():
            theirs[name] = min(t, theirs.get(name, math.inf))
    return ours, theirs


def peers_table(rows, threads: int, isa: str, ov_default: str) -> list[str]:
    """The whole-model table: each row `(label, items, batch, recsys seconds, peer seconds by name,
    top-10 agreement, recsys on 1 thread or None)` against every peer, with the ratio to the faster
    f32 peer (and to OpenVINO's default precision) and the run's date, machine and versions."""
    peer_names = ["ORT", "OV f32", "OV default"] if ov is not None else ["ORT"]
    versions = f"onnxruntime {ort.__version__}" + (f", OpenVINO {ov.__version__.split('-')[0]} (default precision here: "
                                                  f"{ov_default})" if ov is not None else "")
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    amx_note = ("AMX: yes (recsys bf16 rows run the AMX plan the probe measures; OpenVINO's bf16 uses AMX)" if amx
                else "AMX: no")
    lines = [
        f"{datetime.date.today().isoformat()}, {platform.node()} ({cpu_model()}), {os.cpu_count()} cores, {threads} "
        f"threads for everyone; {amx_note}; "
        f"{versions}; recsys fp32 unless a row says bf16 ({isa} kernels); top-{K} with the history excluded; each side's best "
        "median of two alternating rounds",
        "",
        "| model | items | batch | recsys ms/batch | recsys on 1 thread ms | " + " | ".join(f"{p} ms" for p in peer_names)
        + " | faster f32 peer / recsys | " + ("OV default / recsys | " if ov is not None else "")
        + "top-10 agreement, first history |",
        "|---|---|---|---|---|" + "---|" * len(peer_names) + "---|" + ("---|" if ov is not None else "") + "---|",
    ]
    for label, n, batch, ours_s, theirs, agree, single in rows:
        fastest = min(theirs[p] for p in peer_names if p != "OV default")
        cells = ["-" if single is None else f"{1000 * single:.3f}"] + [f"{1000 * theirs[p]:.3f}" for p in peer_names]
        ratio = [f"**{fastest / ours_s:.2f}**"] + ([f"{theirs['OV default'] / ours_s:.2f}"] if ov is not None else [])
        lines.append(f"| {label} | {n} | {batch} | {1000 * ours_s:.3f} | " + " | ".join(cells + ratio) + f" | {agree:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    threads = args.threads
    rows = []
    roofline = []
    peaks = machine_peaks()
    test = [l.split("\t") for l in (FIX / "test_set.tsv").read_text().splitlines()[1:]]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # Plans measured by this run's build, on this run's engines: plan files are keyed by the
        # package version and the engine's weights, so the user's plan cache may hold plans an
        # earlier build measured for the same random weights.
        os.environ.setdefault("RECSYS_PLAN_DIR", str(tmp / "plans"))
        # ---- BERT4Rec: the fixture (trained, L = 50), and the MovieLens-1M shape with random weights
        rng = np.random.default_rng(5)
        bert_specs = [
            ("BERT4Rec (fixture)", FIX / "bert4rec/model.safetensors", FIX / "bert4rec/config.json",
             FIX / "bert4rec/item_id_map.tsv", None),
            ("BERT4Rec (ML-1M shape, random weights)", *ml1m_bert4rec(tmp, rng), "ml1m"),
        ]
        for label, ckpt, cfg_path, map_path, synthetic in bert_specs:
            cfg = json.loads(cfg_path.read_text())
            w = read_safetensors(ckpt)
            engine = tmp / f"bert4rec_{synthetic or 'fixture'}"
            subprocess.run([str(RECSYS), "convert", "--kind", "bert4rec", "--checkpoint", str(ckpt),
                            "--config", str(cfg_path), "--item-map", str(map_path),
                            "--out", str(engine)], check=True, capture_output=True)
            engine_bf16 = tmp / f"bert4rec_{synthetic or 'fixture'}_bf16"
            subprocess.run([str(RECSYS), "convert", "--kind", "bert4rec", "--checkpoint", str(ckpt),
                            "--config", str(cfg_path), "--item-map", str(map_path), "--precision", "bf16",
                            "--out", str(engine_bf16)], check=True, capture_output=True)
            ext_to_int = {int(l.split("\t")[1]): int(l.split("\t")[0]) for l in map_path.read_text().splitlines()[1:]}
            if synthetic:
                histories = ml1m_histories(sorted(ext_to_int), rng)
            else:
                histories = [[int(x) for x in t[2].split()] for t in test[:640]]
            L, N = cfg["max_seq_length"], cfg["n_real_items"]
            sess = bert4rec_session(w, cfg, threads)
            ov_default = sess.ov_default_precision

            def bert_feeds(batch_hist):
                return bert4rec_feeds(batch_hist, ext_to_int, L, N)

            for batch in [1, 64]:
                feeds = [bert_feeds(histories[i * batch:(i + 1) * batch]) for i in range(max(1, min(10, len(histories) // batch)))]
                reps = (300 if batch == 1 else 30) // (3 if synthetic else 1)
                ours, theirs = alternating(lambda: probe(engine, histories, batch, threads, reps, tmp), sess, feeds, reps)
                ort_top = sess.runners["ORT"](feeds[0])[0].tolist()
                int_to_ext = {v: k for k, v in ext_to_int.items()}
                agree = len(set(ours["top_first"]) & {int_to_ext[i] for i in ort_top}) / K
                rows.append((label, N, batch, ours["median_s"], theirs, agree, one_thread(engine, histories, batch, reps)))
                lengths = [len([x for x in h if x in ext_to_int]) for h in histories]
                work = bert4rec_work(cfg, lengths, probe_batches(len(histories), batch, reps))
                roofline.append(roofline_row(label, N, batch, ours, work, (N + 1) * cfg["hidden_size"] * 4, peaks))
                # The bf16 engine, against the same peers (its column to compare: OpenVINO's
                # default, bf16 on CPUs with AVX512-BF16).
                ours = min((probe(engine_bf16, histories, batch, threads, reps, tmp) for _ in range(2)),
                           key=lambda o: o["median_s"])
                agree = len(set(ours["top_first"]) & {int_to_ext[i] for i in ort_top}) / K
                rows.append((label.replace(")", ", bf16)"), N, batch, ours["median_s"], theirs, agree,
                             one_thread(engine_bf16, histories, batch, reps)))

        # ---- Mult-VAE: fixture (N=2000) and synthetic N = 3,416 (MovieLens-1M's catalogue), 20,108
        # (MovieLens-20M's) and 100,000
        specs = [("Mult-VAE (fixture)", None), ("Mult-VAE (ML-1M shape, random weights)", 3416),
                 ("Mult-VAE (ML-20M catalogue, random weights)", 20108), ("Mult-VAE (random weights)", 100_000)]
        for label, n_items in specs:
            if n_items is None:
                w = read_safetensors(FIX / "multivae" / "model.safetensors")
                n_items = w["encoder.0.weight"].shape[1] - 1
                ckpt, cfg_path, map_path = FIX / "multivae/model.safetensors", FIX / "multivae/config.json", FIX / "multivae/item_id_map.tsv"
                ext_ids = [int(l.split("\t")[1]) for l in map_path.read_text().splitlines()[1:]]
            else:
                w, ckpt, cfg_path, map_path, ext_ids = random_multivae(tmp, rng, n_items)
            engine = tmp / f"vae{n_items}"
            subprocess.run([str(RECSYS), "convert", "--kind", "vaecf", "--checkpoint", str(ckpt), "--config", str(cfg_path),
                            "--item-map", str(map_path), "--out", str(engine)], check=True, capture_output=True)
            engine_bf16 = tmp / f"vae{n_items}_bf16"
            subprocess.run([str(RECSYS), "convert", "--kind", "vaecf", "--checkpoint", str(ckpt), "--config", str(cfg_path),
                            "--item-map", str(map_path), "--precision", "bf16", "--out", str(engine_bf16)],
                           check=True, capture_output=True)
            screened = None
            if n_items < 10_000:
                screened = tmp / f"vae{n_items}_screened"
                subprocess.run([str(RECSYS), "convert", "--kind", "vaecf", "--checkpoint", str(ckpt), "--config",
                                str(cfg_path), "--item-map", str(map_path), "--screen", "int8", "--out", str(screened)],
                               check=True, capture_output=True)
            sess = vaecf_session(w, n_items + 1, 200, threads)
            ov_default = sess.ov_default_precision
            if n_items == 2000:
                histories = [[int(x) for x in t[2].split()] for t in test[:640]]
            elif n_items in (3416, 20108):
                histories = ml1m_histories(ext_ids, rng)
            else:
                histories = [[ext_ids[j] for j in rng.choice(n_items, size=int(rng.integers(5, 100)), replace=False)] for _ in range(640)]
            index = {e: i + 1 for i, e in enumerate(ext_ids)}

            def vae_feeds(batch_hist):
                return vaecf_feeds(batch_hist, index, n_items)

            for batch in [1, 64]:
                feeds = [vae_feeds(histories[i * batch:(i + 1) * batch]) for i in range(max(1, min(10, len(histories) // batch)))]
                reps = 200 if batch == 1 else 20
                ours, theirs = alternating(lambda: probe(engine, histories, batch, threads, reps, tmp), sess, feeds, reps)
                ort_top = sess.runners["ORT"](feeds[0])[0].tolist()
                agree = len(set(ours["top_first"]) & {ext_ids[i - 1] for i in ort_top if i > 0}) / K
                rows.append((label, n_items, batch, ours["median_s"], theirs, agree,
                             one_thread(engine, histories, batch, reps)))
                distinct = [len({index[e] for e in h if e in index}) for h in histories]
                work = vaecf_work(n_items + 1, 600, 200, distinct, probe_batches(len(histories), batch, reps))
                roofline.append(roofline_row(label, n_items, batch, ours, work, (n_items + 1) * 600 * 4, peaks))
                if screened is not None:
                    # The exact int8 screen: the fp32 engine's answers, reading a quarter of the bytes.
                    ours = min((probe(screened, histories, batch, threads, reps, tmp) for _ in range(2)),
                               key=lambda o: o["median_s"])
                    agree = len(set(ours["top_first"]) & {ext_ids[i - 1] for i in ort_top if i > 0}) / K
                    rows.append((label.replace(")", ", screened: exact int8 screen)"), n_items, batch,
                                 ours["median_s"], theirs, agree, one_thread(screened, histories, batch, reps)))
                ours = min((probe(engine_bf16, histories, batch, threads, reps, tmp) for _ in range(2)),
                           key=lambda o: o["median_s"])
                agree = len(set(ours["top_first"]) & {ext_ids[i - 1] for i in ort_top if i > 0}) / K
                rows.append((label.replace(")", ", bf16)"), n_items, batch, ours["median_s"], theirs, agree,
                             one_thread(engine_bf16, histories, batch, reps)))

    lines = peers_table(rows, threads, ours["isa"], ov_default)
    lines += [
        "",
        f"Roofline: achieved GFLOP/s per busy core (percent of one core's measured FMA peak, {peaks[0] / 1e9:.1f} GFLOP/s) by kind "
        f"of work, and the output layer's weight bytes per busy second (percent of one core's read bandwidth, "
        f"{peaks[1] / 1e9:.1f} GB/s); busy = thread-seconds per batch in the three kinds, against the batch's mean wall time",
        "",
        "| model | items | batch | dense | attention | output | output GB/s | busy ms (all threads) | wall ms (mean) |",
        "|---|---|---|---|---|---|---|---|---|",
        *roofline,
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
