"""HSTU through a real tritonserver: the official research code's golden answers from requests
carrying ITEM_TIMESTAMPS and QUERY_TIMESTAMP (over HTTP and gRPC, ragged batches under dynamic
batching), the same answers as `recsys predict`; a request without timestamps, or with one too
few, refused by name while the server keeps serving; sessions replayed event by event answered
with the prefix cache (on by default) exactly as without it, through the server and the Python
package's timelines."""

from __future__ import annotations

import gzip
import json
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import FIXTURES
from test_serving import expect_error

# The engine's f32 scores against PyTorch's f32 golden (engine/tests/hstu.rs: within 2.1e-7).
SCORE_ABS_TOL = 1e-5


def cases() -> list[dict]:
    return json.loads((FIXTURES / "hstu" / "golden.json").read_text())["cases"]


def inputs(module, history, times=None, query=None, k=100):
    def int64(name, values, shape):
        t = module.InferInput(name, shape, "INT64")
        t.set_data_from_numpy(np.array(values, dtype=np.int64).reshape(shape))
        return t

    out = [int64("ITEM_IDS", history, [1, len(history)])]
    if times is not None:
        out.append(int64("ITEM_TIMESTAMPS", times, [1, len(times)]))
    if query is not None:
        out.append(int64("QUERY_TIMESTAMP", [query], [1, 1]))
    k_input = module.InferInput("K", [1, 1], "INT32")
    k_input.set_data_from_numpy(np.array([[k]], dtype=np.int32))
    out.append(k_input)
    return out


def check_against_golden(case, ids, scores):
    want = case["topk"]
    torch = {t["external"]: t["score"] for t in want}
    assert len(ids) == len(want), case["case"]
    for pos, (got, w) in enumerate(zip(ids, want)):
        if got != w["external"]:
            # Only where PyTorch's own scores tie within the tolerance (an item just past
            # PyTorch's top 100 is judged by the score served for it).
            assert abs(torch.get(got, scores[pos]) - w["score"]) <= SCORE_ABS_TOL, (case["case"], pos)
    np.testing.assert_allclose(scores, [t["score"] for t in want], atol=SCORE_ABS_TOL)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_timestamped_requests_answer_as_the_official_code_and_as_predict(protocol, server, http, grpc,
                                                                        recsys_bin, repository, tmp_path):
    client, module = (http, httpclient) if protocol == "http" else (grpc, grpcclient)
    golden = cases()
    # Sent concurrently, so the dynamic batcher groups ragged histories into one engine batch
    # (the HTTP client's own connection pool; the gRPC client is thread-safe).
    def request(c):
        return inputs(module, c["history_external"], c["history_timestamps"], c["query_timestamp"])

    if protocol == "http":
        results = [h.get_result() for h in [client.async_infer("hstu", request(c)) for c in golden]]
    else:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda c: client.infer("hstu", request(c)), golden))
    served = [(r.as_numpy("TOP_ITEM_IDS")[0].tolist(), r.as_numpy("TOP_SCORES")[0].tolist()) for r in results]
    # The golden top-100 ranks the history's own items too; the server leaves them out
    # (exclude_seen), so compare the golden list without them.
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"item_ids": c["history_external"], "timestamps": c["history_timestamps"],
                                       "query_timestamp": c["query_timestamp"]}) + "\n" for c in golden))
    subprocess.run([str(recsys_bin), "predict", "--engine", str(repository / "hstu" / "1"), "--input", str(src),
                    "--output", str(dst), "--k", "100"], check=True, capture_output=True)
    offline = [json.loads(line) for line in dst.read_text().splitlines()]
    for case, (ids, scores), answer in zip(golden, served, offline):
        assert ids == answer["item_ids"], case["case"]
        np.testing.assert_array_equal(np.float32(scores), np.float32(answer["scores"]))
        seen = set(case["history_external"])
        kept = [t for t in case["topk"] if t["external"] not in seen]
        # What the golden list holds beyond the history's items is the served list's head.
        check_against_golden({"case": case["case"], "topk": kept}, ids[:len(kept)], scores[:len(kept)])


def test_a_request_without_timestamps_is_refused_by_name_and_the_server_keeps_serving(server, http):
    case = cases()[0]
    history, times = case["history_external"], case["history_timestamps"]
    expect_error(lambda: http.infer("hstu", inputs(httpclient, history)), "400", "no timestamps")
    expect_error(lambda: http.infer("hstu", inputs(httpclient, history, times[1:])), "400",
                 f"{len(times) - 1} timestamp(s) for {len(times)} history ids")
    # Without QUERY_TIMESTAMP the query time is the server's clock: an answer all the same.
    result = http.infer("hstu", inputs(httpclient, history, times, k=5))
    assert len(result.as_numpy("TOP_ITEM_IDS")[0]) == 5
    result = http.infer("hstu", inputs(httpclient, history, times, case["query_timestamp"], k=5))
    assert len(result.as_numpy("TOP_ITEM_IDS")[0]) == 5


def test_the_python_engine_takes_timestamps_and_answers_as_the_official_code(repository):
    import recsys

    engine = recsys.Engine(str(repository / "hstu" / "1"), threads=1)
    golden = cases()
    histories = [c["history_external"] for c in golden]
    times = [c["history_timestamps"] for c in golden]
    queries = [c["query_timestamp"] for c in golden]
    ids, scores = engine.recommend(histories, k=100, exclude_seen=False, timestamps=times,
                                   query_timestamp=queries)
    for case, row_ids, row_scores in zip(golden, ids.tolist(), scores.tolist()):
        check_against_golden(case, row_ids, row_scores)
    # The user embedding [h, 1] against PyTorch's float64 one.
    embeddings = engine.embed(histories, timestamps=times, query_timestamp=queries)
    want = np.array([c["user_embedding_f64"] for c in golden])
    np.testing.assert_allclose(embeddings[:, :-1], want, atol=1e-5)
    np.testing.assert_array_equal(embeddings[:, -1], 1.0)
    # Every item's score, as the ranking gives it.
    scores_all = engine.score(histories[:2], timestamps=times[:2], query_timestamp=queries[:2])
    item_ids = engine.item_ids.tolist()
    for row, case in zip(scores_all, golden[:2]):
        top = case["topk"][0]
        assert abs(row[item_ids.index(top["external"])] - top["score"]) <= SCORE_ABS_TOL
    with pytest.raises(ValueError, match="no timestamps"):
        engine.score(histories[:1])
    # Errors name the Python argument.
    with pytest.raises(ValueError, match="no timestamps"):
        engine.recommend(histories[:1], k=5)
    with pytest.raises(ValueError, match="timestamps= holds 1 lists for 2 histories"):
        engine.recommend(histories[:2], k=5, timestamps=times[:1])
    with pytest.raises(TypeError, match="timestamps= must hold one sequence of integer"):
        engine.recommend(histories[:1], k=5, timestamps=[["soon"]])
    with pytest.raises(ValueError, match="query_timestamp= was given without timestamps="):
        engine.recommend(histories[:1], k=5, query_timestamp=1)
    # One query time for every history is the same as each history's own.
    one, _ = engine.recommend(histories[:2], k=5, timestamps=times[:2], query_timestamp=queries[0])
    each, _ = engine.recommend(histories[:2], k=5, timestamps=times[:2], query_timestamp=[queries[0]] * 2)
    assert one.tolist() == each.tolist()


def fixture_users(count: int) -> list[tuple[list[int], list[int], int]]:
    """The fixture's first test users: (history ids, their timestamps, the target's time)."""
    with gzip.open(FIXTURES / "hstu" / "test_set.tsv.gz", "rt") as f:
        rows = [line.rstrip("\n").split("\t") for line in f][1:count + 1]
    return [([int(x) for x in r[3].split()], [int(x) for x in r[4].split()], int(r[2])) for r in rows]


def metric(server, name: str, model: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") and f'model="{model}"' in line:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for {model}")


def test_replayed_sessions_are_answered_as_without_the_prefix_cache(server, http):
    """Each prefix queried at its next event's time (the official protocol's query time), through
    the model with its prefix cache and the same engine without: the same ids and score bits; the
    server's counters show two rows computed per event after a user's second."""
    computed_before = metric(server, "recsys_prefix_cache_events_computed_total", "hstu")
    reused_before = metric(server, "recsys_prefix_cache_events_reused_total", "hstu")
    calls = 0
    for user, (history, times, target) in enumerate(fixture_users(4)):
        for t in range(1, min(len(history), 40) + 1):
            query = times[t] if t < len(history) else target
            request = inputs(httpclient, history[:t], times[:t], query, k=20)
            cached = http.infer("hstu", request)
            plain = http.infer("hstu_nocache", request)
            assert cached.as_numpy("TOP_ITEM_IDS").tolist() == plain.as_numpy("TOP_ITEM_IDS").tolist(), (user, t)
            np.testing.assert_array_equal(cached.as_numpy("TOP_SCORES"), plain.as_numpy("TOP_SCORES"))
            calls += 1
    computed = metric(server, "recsys_prefix_cache_events_computed_total", "hstu") - computed_before
    reused = metric(server, "recsys_prefix_cache_events_reused_total", "hstu") - reused_before
    # Each user's first call computes 1 row and its second 2 from scratch; every later one 2.
    assert computed == 2 * calls - 4, (computed, calls)
    assert reused > computed, (reused, computed)
    assert metric(server, "recsys_prefix_cache_bytes", "hstu") > 0


def test_python_timelines_take_timestamps_and_answer_each_prefix_as_its_own_call(repository):
    import recsys

    engine_dir = str(repository / "hstu" / "1")
    users = fixture_users(4)
    histories = [h[:30] for h, _, _ in users]
    times = [t[:30] for _, t, _ in users]
    queries = [t[30] if len(t) > 30 else target for _, t, target in users]
    reference = recsys.Engine(engine_dir, threads=1)
    engine = recsys.Engine(engine_dir, threads=1, prefix_cache_bytes=8 << 20)
    timelines = engine.timelines(histories, k=15, timestamps=times, query_timestamp=queries)
    for history, stamps, query, (ids, scores, errors) in zip(histories, times, queries, timelines):
        assert len(ids) == len(history) and errors == [None] * len(history)
        for t in range(1, len(history) + 1):
            at = stamps[t] if t < len(history) else query
            want_ids, want_scores = reference.recommend([history[:t]], k=15, timestamps=[stamps[:t]],
                                                        query_timestamp=at)
            assert ids[t - 1].tolist() == want_ids[0].tolist(), t
            np.testing.assert_array_equal(scores[t - 1], want_scores[0])
    stats = engine.prefix_cache_stats
    # One row at a history's first step, then two per step.
    assert stats["events_computed"] == sum(2 * len(h) - 1 for h in histories), stats
    short = len(histories[1])
    with pytest.raises(ValueError, match=f"timestamps= for history 1 holds {short - 1} times for its {short} ids"):
        engine.timelines(histories[:2], timestamps=[times[0], times[1][:-1]])


# ONNX Runtime on the exported graph against the engine it was exported from (`recsys predict` on
# the same users): fp32 to this tolerance on the top-10 scores; fp16 graphs compute in FP16 and
# int8 (weight-only) graphs multiply float activations, so those are held to a top-10 overlap.
ONNX_FP32_SCORE_ABS_TOL = 1e-4
ONNX_FP16_SCORE_ABS_TOL = 1e-2
# An all-layer W8A8 graph computes what its engine computes (measured: the same top-10 for all 300
# users), but for a value within float rounding of a level boundary landing on the other level.
ONNX_MIN_TOP10_OVERLAP = {"fp16": 0.99, "bf16": 0.99, "int8": 0.98, "w8a8-all": 0.995}
ONNX_W8A8_SCORE_ABS_TOL = 5e-2
# bf16 graphs: BFLOAT16 weights, float activations; the engine rounds each layer's input to bf16.
ONNX_BF16_SCORE_ABS_TOL = 0.1


def graph_feed(engine_dir, histories, times, queries, width=200):
    """The exported graph's inputs: the window's internal indices right-padded with 0, each item's
    timestamp then the query time in the slot after the last item, the history as exclusions."""
    index = {}
    for line in (engine_dir / "item_ids.tsv").read_text().splitlines():
        parts = line.split("\t")
        if not line.startswith("#") and parts[0].isdigit():
            index[int(parts[1])] = int(parts[0])
    seq = np.zeros((len(histories), width), np.int64)
    stamps = np.zeros((len(histories), width + 1), np.int64)
    known = [[(index[x], t) for x, t in zip(h, ts) if x in index] for h, ts in zip(histories, times)]
    exclude = np.zeros((len(histories), max(len(k) for k in known)), np.int64)
    for i, (pairs, query) in enumerate(zip(known, queries)):
        window = pairs[-width:]
        seq[i, :len(window)] = [p for p, _ in window]
        stamps[i, :len(window)] = [t for _, t in window]
        stamps[i, len(window)] = query
        exclude[i, :len(pairs)] = [p for p, _ in pairs]
    return {"item_seq": seq, "timestamps": stamps, "exclude_ids": exclude}


def test_the_onnx_export_answers_as_the_official_code_and_the_engine(recsys_bin, tmp_path):
    import onnx
    import onnxruntime as ort

    src = FIXTURES / "hstu"
    users = fixture_users(300)
    histories = [h for h, _, _ in users]
    times = [t for _, t, _ in users]
    queries = [q for _, _, q in users]
    jsonl = tmp_path / "users.jsonl"
    jsonl.write_text("".join(json.dumps({"item_ids": h, "timestamps": t, "query_timestamp": q}) + "\n"
                             for h, t, q in users))
    golden = cases()
    # W8A8 calibration reads each history's timestamps (and its query time) as predict does.
    calibration = tmp_path / "calibration.jsonl"
    calibration.write_text("".join(json.dumps({"item_ids": h, "timestamps": t, "query_timestamp": q}) + "\n"
                                   for h, t, q in fixture_users(256)))
    flags = {"fp32": ["--precision", "fp32"], "fp16": ["--precision", "fp16"], "bf16": ["--precision", "bf16"],
             "int8": ["--precision", "int8"],
             "w8a8-all": ["--precision", "int8", "--int8-mode", "w8a8-all", "--calibration", str(calibration)]}
    for precision, flag in flags.items():
        engine = tmp_path / precision
        subprocess.run([str(recsys_bin), "convert", "--checkpoint", str(src / "model.safetensors"), "--gin",
                        str(src / "train.gin"), "--item-map", str(src / "item_id_map.tsv"), "--out", str(engine)]
                       + flag, check=True, capture_output=True)
        graph = tmp_path / f"{precision}.onnx"
        subprocess.run([str(recsys_bin), "export-onnx", "--engine", str(engine), "--out", str(graph), "--k", "10"],
                       check=True, capture_output=True)
        onnx.checker.check_model(onnx.load(str(graph)), full_check=True)
        options = ort.SessionOptions()
        if precision == "w8a8-all":
            # QuantizeLinear / DequantizeLinear at ONNX Runtime's reference semantics: its fused
            # u8 x s8 kernels can saturate on CPUs without VNNI, which no TensorRT build does
            # (tests/integration/test_onnx_export.py says more).
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        scores, items = session.run(["topk_scores", "topk_items"], graph_feed(engine, histories, times, queries))
        out = tmp_path / f"{precision}.jsonl"
        subprocess.run([str(recsys_bin), "predict", "--engine", str(engine), "--input", str(jsonl), "--output",
                        str(out), "--k", "10"], check=True, capture_output=True)
        answers = [json.loads(line) for line in out.read_text().splitlines()]
        external = {int(p[0]): int(p[1]) for p in (line.split("\t") for line in
                    (engine / "item_ids.tsv").read_text().splitlines()) if p[0].isdigit()}
        items = np.vectorize(external.get)(items)
        overlap = np.mean([len(set(a["item_ids"]) & set(row.tolist())) / 10 for a, row in zip(answers, items)])
        if precision == "fp32":
            for a, row, row_scores in zip(answers, items, scores):
                np.testing.assert_allclose(row_scores, a["scores"], atol=ONNX_FP32_SCORE_ABS_TOL)
                for pos, (ours, theirs) in enumerate(zip(a["item_ids"], row.tolist())):
                    # Only near-ties may trade places.
                    assert ours == theirs or abs(a["scores"][pos] - row_scores[pos]) <= ONNX_FP32_SCORE_ABS_TOL
            # Every item's score and the user embedding against the official float64 golden.
            full = tmp_path / "fp32-all.onnx"
            subprocess.run([str(recsys_bin), "export-onnx", "--engine", str(engine), "--out", str(full),
                            "--all-scores", "--embedding"], check=True, capture_output=True)
            session = ort.InferenceSession(str(full), providers=["CPUExecutionProvider"])
            feed = graph_feed(engine, [c["history_external"] for c in golden], [c["history_timestamps"] for c in golden],
                              [c["query_timestamp"] for c in golden])
            feed["exclude_ids"] = np.zeros((len(golden), 1), np.int64)
            all_scores, embedding = session.run(["scores", "user_embedding"], feed)
            for i, case in enumerate(golden):
                want = case["topk"]
                np.testing.assert_allclose(all_scores[i, [t["internal"] for t in want]], [t["score"] for t in want],
                                           atol=SCORE_ABS_TOL)
                np.testing.assert_allclose(embedding[i, :-1], case["user_embedding_f64"], atol=1e-5)
        else:
            tol = {"fp16": ONNX_FP16_SCORE_ABS_TOL, "bf16": ONNX_BF16_SCORE_ABS_TOL,
                   "int8": ONNX_FP32_SCORE_ABS_TOL * 100, "w8a8-all": ONNX_W8A8_SCORE_ABS_TOL}[precision]
            assert overlap >= ONNX_MIN_TOP10_OVERLAP[precision], (precision, overlap)
            assert np.abs(scores[:, 0] - [a["scores"][0] for a in answers]).max() <= tol, precision
        print(f"HSTU {precision} graph: top-10 overlap with the engine {overlap:.4f}")
