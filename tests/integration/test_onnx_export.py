"""`recsys export-onnx` checked in onnxruntime: every exported graph is valid ONNX (onnx.checker, full
check), the fp32 graphs reproduce PyTorch's golden logits, and each precision's top-k is compared with
the engine it was exported from (`recsys predict` on the same users): fp32 must agree to a named
tolerance; fp16 graphs compute in FP16 (the engine in fp32 from fp16 weights) and get their own
tolerance, as do bf16 graphs (BFLOAT16 weights, float activations; the engine rounds them to bf16); int8 graphs are compared at onnxruntime's reference semantics of QuantizeLinear /
DequantizeLinear (graph optimizations off: on CPUs without VNNI its fused u8 x s8 int8 kernels can
saturate, which no TensorRT build does), where an all-layer W8A8 engine (`--int8-mode w8a8-all`)
computes what its graph computes. Other pairs differ by design (weight-only: the engine rounds dense
inputs to int16 per request, the graph keeps them float; w8a8: the graph quantizes every dense input,
the engine only the output layer's), so their top-k overlap is measured, reported and held to a
floor."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import FIXTURES

# ORT and PyTorch, both f32, on the same weights: only summation order differs.
LOGIT_ABS_TOL = 5e-5
# ORT against the engine on the top-k scores at fp32.
TOPK_SCORE_ABS_TOL = 1e-4
# FP16 graphs against their engine (fp16 weights, fp32 compute) on the top-k scores (measured up to
# 4.1e-3 on BERT4Rec, 2.1e-3 on Mult-VAE).
FP16_SCORE_ABS_TOL = 1e-2
# The user embedding of an all-layer W8A8 graph against its engine: the same int8 levels, except
# where a value sits within float rounding of a level boundary and lands on the other level; through
# BERT4Rec's LayerNorms one such flip moves the embedding by up to ~3e-2 (measured), so most rows
# agree to 2e-3 and every row to 5e-2.
W8A8_EMBEDDING_ABS_TOL = 5e-2
# bf16 graphs (BFLOAT16 weights cast to float, activations left unrounded) against their engine,
# which rounds each layer's input to bf16 (2^-9 relative): on the top-k scores (measured up to
# 4.2e-2 on BERT4Rec, 2.2e-2 GRU4Rec, 1.9e-2 SASRec, 8.1e-3 Mult-VAE).
BF16_SCORE_ABS_TOL = 0.1
W8A8_EMBEDDING_TYPICAL_ABS_TOL = 2e-3
K = 100
USERS = 500
# Mean top-10 overlap between graph and engine below which the export is wrong, not just rounded.
# Measured (500 users): fp16 0.997-0.999, bf16 0.997-0.998, int8-wo 1.0, int8-w8a8 0.980-0.988, int8-w8a8-all 1.0.
MIN_TOP10_OVERLAP = {"fp16": 0.99, "bf16": 0.99, "int8-wo": 0.98, "int8-w8a8": 0.97, "int8-w8a8-all": 0.995}
# Dense layers whose inputs an all-layer W8A8 graph quantizes: BERT4Rec 2 x 6 + the head, Mult-VAE
# the mu layer and the decoder's hidden layer (the first layer is a gather-sum), SASRec 2 x 6,
# GRU4Rec the GRU's input side and the dense layer (the GRU operator keeps its state float).
DENSE_LAYERS = {"bert4rec": 13, "vaecf": 2, "sasrec": 12, "gru4rec": 2}

MODELS = {
    "bert4rec": ("bert4rec", "bert4rec", "model.safetensors"),
    "vaecf": ("vaecf", "multivae", "model.safetensors"),
    "sasrec": ("sasrec", "sasrec", "model.safetensors"),
    "gru4rec": ("gru4rec", "gru4rec", "model.safetensors"),
}
# The models that read an ordered history (`item_seq`) rather than a set of items (`items`).
SEQUENTIAL = ("bert4rec", "sasrec", "gru4rec")
PRECISIONS = {
    "fp32": ["--precision", "fp32"],
    "fp16": ["--precision", "fp16"],
    "bf16": ["--precision", "bf16"],
    "int8-wo": ["--precision", "int8"],
    "int8-w8a8": ["--precision", "int8", "--int8-mode", "w8a8", "--calibration", "CAL"],
    "int8-w8a8-all": ["--precision", "int8", "--int8-mode", "w8a8-all", "--calibration", "CAL"],
}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    dtypes = {"F32": np.float32, "F64": np.float64, "I64": np.int64}
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        s, e = meta["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + s : 8 + n + e], dtype=dtypes[meta["dtype"]]).reshape(meta["shape"])
    return out


def item_index(engine: Path) -> dict[int, int]:
    lines = (engine / "item_ids.tsv").read_text().splitlines()
    rows = [line.split("\t") for line in lines if line and not line.startswith("#")]
    start = 1 if not rows[0][0].isdigit() else 0
    return {int(ext): int(idx) for idx, ext in rows[start:]}


@pytest.fixture(scope="module")
def users(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    rows = [line.split("\t") for line in (FIXTURES / "test_set.tsv").read_text().splitlines()[1:]]
    histories = [[int(x) for x in r[2].split()] for r in rows[:USERS]]
    path = tmp_path_factory.mktemp("onnx_users") / "users.jsonl"
    path.write_text("".join(json.dumps({"user_id": i, "item_ids": h}) + "\n" for i, h in enumerate(histories)))
    return path, histories


@pytest.fixture(scope="module")
def exports(recsys_bin, tmp_path_factory):
    """Engines and their ONNX exports, built once: {(model, precision): (engine, onnx_file, stdout)}."""
    root = tmp_path_factory.mktemp("onnx_exports")
    cal = Path(__file__).resolve().parents[2] / "examples" / "calibration.jsonl"
    out = {}
    for model, (kind, fixture_dir, ckpt) in MODELS.items():
        for precision, flags in PRECISIONS.items():
            engine = root / f"{model}_{precision}"
            src = FIXTURES / fixture_dir
            subprocess.run(
                [str(recsys_bin), "convert", "--kind", kind, "--checkpoint", str(src / ckpt),
                 "--config", str(src / "config.json"), "--item-map", str(src / "item_id_map.tsv"),
                 "--out", str(engine)] + [str(cal) if f == "CAL" else f for f in flags],
                check=True, capture_output=True, text=True)
            onnx_file = root / f"{model}_{precision}.onnx"
            run = subprocess.run(
                [str(recsys_bin), "export-onnx", "--engine", str(engine), "--out", str(onnx_file), "--k", str(K)],
                check=True, capture_output=True, text=True)
            out[(model, precision)] = (engine, onnx_file, run.stdout)
    return out


def graph_inputs(model: str, engine: Path, histories: list[list[int]]) -> dict[str, np.ndarray]:
    """The graph's inputs for a batch of histories in external ids, built as its doc string says."""
    index = item_index(engine)
    mapped = [[index[x] for x in h if x in index] for h in histories]
    width = max(len(h) for h in mapped)
    exclude = np.zeros((len(mapped), width), dtype=np.int64)
    for i, h in enumerate(mapped):
        exclude[i, : len(h)] = h
    if model == "bert4rec":
        manifest = json.loads((engine / "manifest.json").read_text())["model"]
        length, mask = manifest["max_len"], manifest["n_items"] + 1
        seq = np.zeros((len(mapped), length), dtype=np.int64)
        for i, h in enumerate(mapped):
            tail = h[-(length - 1):]
            seq[i, : len(tail)] = tail
            seq[i, len(tail)] = mask
        return {"item_seq": seq, "exclude_ids": exclude}
    if model in ("sasrec", "gru4rec"):
        length = json.loads((engine / "manifest.json").read_text())["model"]["max_len"]
        seq = np.zeros((len(mapped), length), dtype=np.int64)
        for i, h in enumerate(mapped):
            tail = h[-length:]
            seq[i, : len(tail)] = tail
        return {"item_seq": seq, "exclude_ids": exclude}
    return {"items": exclude.copy(), "exclude_ids": exclude}


def run_graph(onnx_file: Path, feeds: dict[str, np.ndarray], reference: bool = False) -> list[np.ndarray]:
    """`reference`: graph optimizations off, so every operator runs with its ONNX semantics (no fused
    int8 kernels)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    if reference:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(onnx_file), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def engine_topk(recsys_bin: Path, engine: Path, users_file: Path, tmp_path: Path) -> list[dict]:
    out = tmp_path / f"{engine.name}.jsonl"
    subprocess.run([str(recsys_bin), "predict", "--engine", str(engine), "--input", str(users_file),
                    "--output", str(out), "--k", str(K)], check=True, capture_output=True, text=True)
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_export_is_valid_onnx_with_the_documented_interface(exports, model, precision):
    engine, onnx_file, stdout = exports[(model, precision)]
    proto = onnx.load(str(onnx_file))
    onnx.checker.check_model(proto, full_check=True)
    assert proto.opset_import[0].version >= 17
    names = [i.name for i in proto.graph.input]
    assert names == (["item_seq", "exclude_ids"] if model in SEQUENTIAL else ["items", "exclude_ids"])
    assert [o.name for o in proto.graph.output] == ["topk_scores", "topk_items"]
    ops = [n.op_type for n in proto.graph.node]
    init_types = {t.data_type for t in proto.graph.initializer}
    if precision == "fp32":
        assert "DequantizeLinear" not in ops and onnx.TensorProto.FLOAT16 not in init_types
    if precision == "fp16":
        assert onnx.TensorProto.FLOAT16 in init_types and "DequantizeLinear" not in ops
    if precision == "fp16":
        # Typed FP16 end to end: every GEMM computes in FP16 (LayerNorm and Softmax sit between Casts).
        inferred = onnx.shape_inference.infer_shapes(proto)
        types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
        gemms = [n for n in proto.graph.node if n.op_type in ("MatMul", "Gemm")]
        assert gemms and all(types[n.output[0]] == onnx.TensorProto.FLOAT16 for n in gemms)
    if precision == "bf16":
        # The engine's bf16 weights, typed BFLOAT16, each cast to the float the graph computes in.
        assert onnx.TensorProto.BFLOAT16 in init_types and "DequantizeLinear" not in ops
        assert onnx.TensorProto.FLOAT16 not in init_types
    if precision.startswith("int8"):
        assert onnx.TensorProto.INT8 in init_types
        consumers = {}
        for n in proto.graph.node:
            for i, name in enumerate(n.input):
                consumers.setdefault(name, []).append((n, i))
        # Every int8 weight's DequantizeLinear feeds a MatMul/Gemm weight or a Gather table directly,
        # its per-row scales along the output channels (axis 1 of a MatMul's [in, out], axis 0 of a
        # transB Gemm's or a table's rows).
        weight_dq = [n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0].endswith("_int8")]
        assert weight_dq
        for n in weight_dq:
            axis = next(a.i for a in n.attribute if a.name == "axis")
            for user, slot in consumers[n.output[0]]:
                assert (user.op_type, slot, axis) in {("MatMul", 1, 1), ("Gemm", 1, 0), ("Gather", 0, 0)}, \
                    (user.op_type, slot, axis)
        quantize = ops.count("QuantizeLinear")
        expected = 0 if precision == "int8-wo" else DENSE_LAYERS[model] + 1
        assert quantize == expected, "W8A8 quantizes every dense layer's input and the output layer's"
    assert "TensorRT 10 rules: passed" in stdout
    metadata = {p.key: p.value for p in proto.metadata_props}
    assert metadata["recsys.kind"] == model
    assert f"opset 17" in stdout


@pytest.mark.parametrize("model,fixture_dir", [("bert4rec", "bert4rec"), ("vaecf", "multivae")])
def test_fp32_scores_match_pytorch(recsys_bin, exports, tmp_path, model, fixture_dir):
    engine, _, _ = exports[(model, "fp32")]
    all_scores = tmp_path / "scores.onnx"
    subprocess.run([str(recsys_bin), "export-onnx", "--engine", str(engine), "--out", str(all_scores), "--all-scores"],
                   check=True, capture_output=True)
    golden = read_safetensors(FIXTURES / fixture_dir / "golden.safetensors")
    if model == "bert4rec":
        feeds = {"item_seq": golden["input_ids"]}
    else:
        multihot = golden["input_multihot_f32"]
        width = int(multihot.sum(1).max())
        items = np.zeros((len(multihot), width), dtype=np.int64)
        for i, row in enumerate(multihot):
            idx = np.nonzero(row)[0]
            items[i, : len(idx)] = idx
        feeds = {"items": items}
    feeds["exclude_ids"] = np.zeros((len(feeds[next(iter(feeds))]), 1), dtype=np.int64)
    (scores,) = run_graph(all_scores, feeds)
    assert np.all(np.isneginf(scores[:, 0])), "PAD is never a candidate"
    diff = np.abs(scores[:, 1:] - golden["logits_f32"][:, 1:]).max()
    print(f"{model}: max |ONNX fp32 - PyTorch f32| over {len(scores)} golden cases = {diff:.2e}")
    assert diff <= LOGIT_ABS_TOL


@pytest.mark.parametrize("model", ["sasrec", "gru4rec"])
def test_fp32_top100_matches_recbole(recsys_bin, exports, tmp_path, model):
    """RecBole's own SASRec and GRU4Rec gave the fixtures' golden top-100 (with scores): the fp32
    graph ranks the same items with the same scores."""
    engine, onnx_file, _ = exports[(model, "fp32")]
    cases = [c for c in json.loads((FIXTURES / model / "golden.json").read_text())["cases"] if c["topk"]]
    ext = {idx: e for e, idx in item_index(engine).items()}
    histories = [[ext[i] for i in c["effective_history_internal"]] for c in cases]
    scores, items = run_graph(onnx_file, graph_inputs(model, engine, histories))
    max_diff = 0.0
    for i, case in enumerate(cases):
        want = case["topk"]
        want_scores = np.array([w["score"] for w in want], dtype=np.float64)
        max_diff = max(max_diff, float(np.abs(scores[i] - want_scores).max()))
        for r, (got, w) in enumerate(zip(items[i], want)):
            if int(got) != w["internal"]:
                # Only where RecBole's own scores tie within the tolerance.
                assert abs(want_scores[r] - next(x["score"] for x in want if x["internal"] == int(got))) \
                    <= LOGIT_ABS_TOL, (case["case"], r)
    print(f"{model}: max |ONNX fp32 - RecBole| over the top-100 of {len(cases)} golden cases = {max_diff:.2e}")
    assert max_diff <= LOGIT_ABS_TOL


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_topk_agrees_with_the_engine(recsys_bin, exports, users, tmp_path, model, precision):
    engine, onnx_file, _ = exports[(model, precision)]
    users_file, histories = users
    ours = engine_topk(recsys_bin, engine, users_file, tmp_path)
    feeds = graph_inputs(model, engine, histories)
    reference = precision.startswith("int8")
    scores, items = run_graph(onnx_file, feeds, reference=reference)
    ext = {idx: e for e, idx in item_index(engine).items()}
    if reference:
        # What onnxruntime's optimized CPU kernels give, for the record.
        _, fused = run_graph(onnx_file, feeds)
        fused10 = np.mean([len(set(fused[i][:10]) & set(items[i][:10])) / 10 for i in range(len(ours))])
        print(f"{model} {precision}: onnxruntime's optimized int8 kernels agree with its reference "
              f"semantics on {fused10:.4f} of the top-10")
    overlap10, overlap100, identical10, max_score_diff = [], [], 0, 0.0
    for i, rec in enumerate(ours):
        graph_ids = [ext[int(j)] for j in items[i]]
        assert not set(graph_ids) & set(histories[i]), "history items are excluded"
        overlap10.append(len(set(graph_ids[:10]) & set(rec["item_ids"][:10])) / 10)
        overlap100.append(len(set(graph_ids) & set(rec["item_ids"])) / K)
        identical10 += graph_ids[:10] == rec["item_ids"][:10]
        max_score_diff = max(max_score_diff, float(np.abs(scores[i] - np.asarray(rec["scores"])).max()))
    line = (f"{model} {precision}: top-10 overlap {np.mean(overlap10):.4f}, top-100 overlap {np.mean(overlap100):.4f}, "
            f"identical top-10 {identical10}/{len(ours)}, max |score diff| at rank r {max_score_diff:.2e}")
    print(line)
    if precision == "fp32":
        assert max_score_diff <= TOPK_SCORE_ABS_TOL, line
        # Ranks may swap only between scores closer than the tolerance.
        for i, rec in enumerate(ours):
            graph_ids = [ext[int(j)] for j in items[i]]
            for r, (a, b) in enumerate(zip(graph_ids, rec["item_ids"])):
                if a != b:
                    assert abs(rec["scores"][r] - float(scores[i][r])) <= TOPK_SCORE_ABS_TOL
                    assert abs(rec["scores"][r] - rec["scores"][min(r + 1, K - 1)]) <= 2 * TOPK_SCORE_ABS_TOL \
                        or abs(rec["scores"][r] - rec["scores"][max(r - 1, 0)]) <= 2 * TOPK_SCORE_ABS_TOL, line
    else:
        assert np.mean(overlap10) >= MIN_TOP10_OVERLAP[precision], line
    if precision == "fp16":
        assert max_score_diff <= FP16_SCORE_ABS_TOL, line
    if precision == "bf16":
        assert max_score_diff <= BF16_SCORE_ABS_TOL, line
    if precision == "int8-w8a8-all":
        assert identical10 >= 0.98 * len(ours), line


@pytest.mark.parametrize("dedup", ["scatter", "pairs"])
def test_mult_vae_duplicate_history_items_count_once_with_either_dedup(recsys_bin, exports, users, tmp_path, dedup):
    """Mult-VAE's input is a set: a history given with repeated items (in any slots, padded to the
    batch's longest) ranks as the same history without them, in the graph of either duplicate
    rule (`--dedup`) as in the engine."""
    engine, _, _ = exports[("vaecf", "fp32")]
    onnx_file = tmp_path / f"vaecf_{dedup}.onnx"
    subprocess.run([str(recsys_bin), "export-onnx", "--engine", str(engine), "--out", str(onnx_file), "--k", str(K),
                    "--dedup", dedup], check=True, capture_output=True, text=True)
    _, histories = users
    histories = histories[:64]
    rng = np.random.default_rng(7)
    repeated = []
    for h in histories:
        extra = [h[int(i)] for i in rng.integers(0, len(h), size=1 + len(h) // 2)]
        mixed = h + extra
        rng.shuffle(mixed)
        repeated.append(mixed)
    users_file = tmp_path / "repeated.jsonl"
    users_file.write_text("".join(json.dumps({"user_id": i, "item_ids": h}) + "\n" for i, h in enumerate(histories)))
    ours = engine_topk(recsys_bin, engine, users_file, tmp_path)
    scores, items = run_graph(onnx_file, graph_inputs("vaecf", engine, repeated))
    plain_scores, plain_items = run_graph(onnx_file, graph_inputs("vaecf", engine, histories))
    ext = {idx: e for e, idx in item_index(engine).items()}
    for i, rec in enumerate(ours):
        graph_ids = [ext[int(j)] for j in items[i]]
        assert graph_ids[:10] == rec["item_ids"][:10], f"history {i}: repeated items changed the top-10"
        assert float(np.abs(scores[i] - np.asarray(rec["scores"])).max()) <= TOPK_SCORE_ABS_TOL, i
        assert float(np.abs(scores[i] - plain_scores[i]).max()) <= TOPK_SCORE_ABS_TOL, i
        assert list(items[i][:10]) == list(plain_items[i][:10]), i


def test_model_repository_for_the_onnxruntime_backend(recsys_bin, exports, tmp_path):
    engine, _, _ = exports[("bert4rec", "int8-w8a8-all")]
    repo = tmp_path / "repo"
    cmd = [str(recsys_bin), "export-onnx", "--engine", str(engine), "--model-repository", str(repo),
           "--model-name", "b4r_onnx", "--max-batch-size", "32"]
    subprocess.run(cmd, check=True, capture_output=True)
    config = (repo / "b4r_onnx" / "config.pbtxt").read_text()
    assert 'backend: "onnxruntime"' in config and "max_batch_size: 32" in config
    assert '{ name: "item_seq" data_type: TYPE_INT64 dims: [ 50 ] }' in config
    assert '{ name: "topk_items" data_type: TYPE_INT64 dims: [ 100 ] }' in config
    assert (repo / "b4r_onnx" / "1" / "model.onnx").is_file()
    assert (repo / "b4r_onnx" / "item_ids.tsv").read_text() == (engine / "item_ids.tsv").read_text()
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode != 0 and "already exists; pass --force" in again.stderr
    subprocess.run(cmd + ["--force"], check=True, capture_output=True)
    bad = subprocess.run(cmd[:-4] + ["--model-name", "../escape"], capture_output=True, text=True)
    assert bad.returncode != 0 and "must be letters" in bad.stderr


def test_bad_k_is_refused_with_the_valid_range(recsys_bin, exports, tmp_path):
    engine, _, _ = exports[("vaecf", "fp32")]
    export = [str(recsys_bin), "export-onnx", "--engine", str(engine), "--out", str(tmp_path / "x.onnx"), "--k"]
    # Beyond this engine's catalogue: a bad input for this engine (exit status 1).
    run = subprocess.run(export + ["3000"], capture_output=True, text=True)
    assert run.returncode == 1 and "k = 3000 is out of range" in run.stderr and "1..=2000" in run.stderr
    # Beyond TensorRT's TopK limit: refused as a flag, before the engine is read (exit status 2).
    run = subprocess.run(export + ["5000"], capture_output=True, text=True)
    assert run.returncode == 2 and "3840" in run.stderr and "--all-scores" in run.stderr
    assert not (tmp_path / "x.onnx").exists()


def test_external_data_side_file_loads_in_onnxruntime(recsys_bin, exports, users, tmp_path):
    engine, onnx_file, _ = exports[("vaecf", "fp32")]
    split = tmp_path / "split.onnx"
    subprocess.run([str(recsys_bin), "export-onnx", "--engine", str(engine), "--out", str(split), "--external-data",
                    "--k", str(K)], check=True, capture_output=True)
    assert (tmp_path / "split.onnx.data").stat().st_size > 0.9 * onnx_file.stat().st_size
    assert split.stat().st_size < 0.1 * onnx_file.stat().st_size
    feeds = graph_inputs("vaecf", engine, users[1][:16])
    a = run_graph(onnx_file, feeds)
    b = run_graph(split, feeds)
    assert np.array_equal(a[1], b[1]) and np.array_equal(a[0], b[0])


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("precision", ["fp32", "int8-w8a8-all"])
def test_candidate_reranking_and_the_embedding_agree_with_the_engine(recsys_bin, exports, users, tmp_path, model,
                                                                      precision):
    """--candidates --embedding, in onnxruntime: the top-10 among each user's candidates (padded with 0)
    and the user embedding, against `recsys predict` with the same "candidate_item_ids" and
    --return-embedding."""
    engine, _, _ = exports[(model, precision)]
    graph = tmp_path / "rerank.onnx"
    subprocess.run([str(recsys_bin), "export-onnx", "--engine", str(engine), "--out", str(graph), "--k", "10",
                    "--candidates", "--embedding"], check=True, capture_output=True)
    proto = onnx.load(str(graph))
    onnx.checker.check_model(proto, full_check=True)
    assert [i.name for i in proto.graph.input][-2:] == ["candidate_ids", "exclude_ids"]
    assert [o.name for o in proto.graph.output] == ["topk_scores", "topk_items", "user_embedding"]
    ops = [n.op_type for n in proto.graph.node]
    assert "Gemm" not in ops, "no full-catalogue product: only the candidates' rows are scored"

    index = item_index(engine)
    ext = {idx: e for e, idx in index.items()}
    rng = np.random.default_rng(11)
    histories = users[1][:64]
    catalogue = sorted(index)
    candidates = []
    for h in histories:
        # 20..300 random items and three of the history (left out by the exclusions).
        picked = [int(x) for x in rng.choice(catalogue, size=int(rng.integers(20, 300)), replace=False)]
        candidates.append(picked + h[:3])
    lines = tmp_path / "candidates.jsonl"
    lines.write_text("".join(json.dumps({"item_ids": h, "candidate_item_ids": c}) + "\n"
                             for h, c in zip(histories, candidates)))
    out = tmp_path / "ranked.jsonl"
    subprocess.run([str(recsys_bin), "predict", "--engine", str(engine), "--input", str(lines), "--output", str(out),
                    "--k", "10", "--return-embedding"], check=True, capture_output=True)
    ours = [json.loads(line) for line in out.read_text().splitlines()]

    feeds = graph_inputs(model, engine, histories)
    width = max(len(c) for c in candidates)
    feeds["candidate_ids"] = np.zeros((len(candidates), width), dtype=np.int64)
    for i, c in enumerate(candidates):
        feeds["candidate_ids"][i, : len(c)] = [index[x] for x in c]
    scores, items, embedding = run_graph(graph, feeds, reference=precision != "fp32")
    assert embedding.shape == (len(histories), len(ours[0]["embedding"])) and np.all(embedding[:, -1] == 1.0)
    expected = np.asarray([r["embedding"] for r in ours])
    if precision == "fp32":
        np.testing.assert_allclose(embedding, expected, atol=TOPK_SCORE_ABS_TOL)
    else:
        row_diff = np.abs(embedding - expected).max(axis=1)
        print(f"{model} {precision} embedding: median row |diff| {np.median(row_diff):.2e}, max {row_diff.max():.2e}")
        assert np.median(row_diff) <= W8A8_EMBEDDING_TYPICAL_ABS_TOL and row_diff.max() <= W8A8_EMBEDDING_ABS_TOL
    overlap = []
    for i, rec in enumerate(ours):
        graph_ids = [ext[int(j)] for j in items[i]]
        assert set(graph_ids) <= set(candidates[i]) and not set(graph_ids) & set(histories[i])
        overlap.append(len(set(graph_ids) & set(rec["item_ids"])) / 10)
        if precision == "fp32":
            np.testing.assert_allclose(scores[i], rec["scores"], atol=TOPK_SCORE_ABS_TOL)
    print(f"{model} {precision} candidates: top-10 overlap with the engine {np.mean(overlap):.4f}")
    assert np.mean(overlap) >= (0.999 if precision == "fp32" else MIN_TOP10_OVERLAP[precision])
