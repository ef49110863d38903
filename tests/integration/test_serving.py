"""The recsys backend inside a real tritonserver, driven by the real tritonclient over HTTP and gRPC."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import BROKEN_MODELS, golden_cases

# The test-only id that makes a backend built with the `panic-trigger` feature panic in Execute.
PANIC_TRIGGER_ID = -7_777_777_777
PANIC_IN_OUTPUT_TRIGGER_ID = -7_777_777_778


def make_inputs(module, history, *, k=None, exclude=None, candidates=None, strings=False):
    def ids(name, values):
        if strings:
            arr = np.array([[str(v).encode() if not isinstance(v, bytes) else v for v in values]], dtype=np.object_)
            t = module.InferInput(name, list(arr.shape), "BYTES")
        else:
            arr = np.array([values], dtype=np.int64).reshape(1, len(values))
            t = module.InferInput(name, list(arr.shape), "INT64")
        t.set_data_from_numpy(arr)
        return t

    inputs = [ids("ITEM_IDS", history)]
    if k is not None:
        t = module.InferInput("K", [1, 1], "INT32")
        t.set_data_from_numpy(np.array([[k]], dtype=np.int32))
        inputs.append(t)
    if exclude is not None:
        inputs.append(ids("EXCLUDE_ITEM_IDS", exclude))
    if candidates is not None:
        inputs.append(ids("CANDIDATE_ITEM_IDS", candidates))
    return inputs


def top(result):
    return result.as_numpy("TOP_ITEM_IDS")[0].tolist(), result.as_numpy("TOP_SCORES")[0].tolist()


@pytest.mark.parametrize("model,model_dir", [("bert4rec", "bert4rec"), ("vaecf", "multivae"), ("sasrec", "sasrec"),
                                             ("gru4rec", "gru4rec")])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_answers_equal_pytorch_golden_and_the_engine(model, model_dir, protocol, http, grpc, predict):
    client, module = (http, httpclient) if protocol == "http" else (grpc, grpcclient)
    cases = golden_cases(model_dir)
    # SASRec and GRU4Rec answer from the history's last item: a history with no known item has no
    # answer (RecBole's golden file has none), and the server refuses it by name.
    for case in [c for c in cases if c["topk"] is None]:
        expect_error(lambda: client.infer(model, make_inputs(module, case["history_ext"], k=100)),
                     "INVALID_ARGUMENT" if protocol == "grpc" else "400", "holds no item known to the model")
    cases = [c for c in cases if c["topk"] is not None]
    offline = predict(model, [c["history_ext"] for c in cases], 100)
    for case, (engine_ids, engine_scores) in zip(cases, offline):
        result = client.infer(model, make_inputs(module, case["history_ext"], k=100))
        ids, scores = top(result)
        assert ids == [t["external"] for t in case["topk"]], f"case {case['case']} differs from PyTorch"
        assert ids == engine_ids, f"case {case['case']} differs from recsys predict"
        np.testing.assert_array_equal(np.float32(scores), np.float32(engine_scores))
        assert result.get_response()["parameters"]["unknown_item_count"] == len(case["unknown_ext"]) if protocol == "http" else True


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_candidates_are_ranked_among_themselves_with_pytorchs_scores(protocol, http, grpc):
    client, module = (http, httpclient) if protocol == "http" else (grpc, grpcclient)
    for case in golden_cases("bert4rec")[:8]:
        top100 = case["topk"]
        # Four of PyTorch's top-100 out of order, an id the model does not know, and the history.
        picked = [top100[i] for i in (70, 10, 50, 30)]
        candidates = [t["external"] for t in picked] + [-99] + case["effective_history_ext"][:2]
        result = client.infer("bert4rec", make_inputs(module, case["history_ext"], k=3, candidates=candidates))
        ids, scores = top(result)
        want = [top100[i] for i in (10, 30, 50)]
        assert ids == [t["external"] for t in want], f"case {case['case']}"
        np.testing.assert_allclose(scores, [t["score"] for t in want], atol=5e-5)
        if protocol == "http":
            assert result.get_response()["parameters"]["unknown_candidate_count"] == 1
    # More candidates than max_candidates (10,000 by default): INVALID_ARG naming the limit.
    expect_error(
        lambda: client.infer("bert4rec", make_inputs(module, [10011403], candidates=list(range(1, 10_002)))),
        "400" if protocol == "http" else None, "max_candidates 10000",
    )


def test_an_int8_engine_serves_the_engines_answers_close_to_fp32(http, predict):
    cases = golden_cases("multivae")[:16]
    offline = predict("vaecf_int8", [c["history_ext"] for c in cases], 10)
    overlap = []
    for case, (engine_ids, engine_scores) in zip(cases, offline):
        ids, scores = top(http.infer("vaecf_int8", make_inputs(httpclient, case["history_ext"])))
        assert ids == engine_ids
        np.testing.assert_array_equal(np.float32(scores), np.float32(engine_scores))
        fp32 = [t["external"] for t in case["topk"][:10]]
        overlap.append(len(set(ids) & set(fp32)) / 10)
    assert np.mean(overlap) >= 0.9, overlap


def test_default_k_exclusions_and_string_catalogue(http):
    ids, _ = top(http.infer("bert4rec", make_inputs(httpclient, [10011403, 10011207])))
    assert len(ids) == 10 and 10011403 not in ids and 10011207 not in ids
    excluded = ids[:3]
    ids2, _ = top(http.infer("bert4rec", make_inputs(httpclient, [10011403, 10011207], k=5, exclude=excluded)))
    assert ids2 == ids[3:8]
    sids, sscores = top(http.infer("bert4rec_str", make_inputs(httpclient, ["sku-10011403", "sku-10011207"], strings=True)))
    assert [s.decode() for s in sids] == [f"sku-{i}" for i in ids]


def test_concurrent_ragged_requests_are_batched_and_each_right(server, grpc, predict):
    rng = np.random.default_rng(7)
    pool = sorted({i for c in golden_cases("bert4rec") for i in c["effective_history_ext"]})
    # 64 histories, lengths spread over 1..200 (BERT4Rec truncates past 49, which is tested too).
    lengths = np.linspace(1, 200, 64).round().astype(int)
    histories = [[int(x) for x in rng.choice(pool, size=length)] for length in lengths]
    expected = predict("bert4rec", histories, 10)
    before = grpc.get_inference_statistics("bert4rec_batching", as_json=True)

    results: dict[int, object] = {}
    done = threading.Event()

    def callback(i, result, error):
        results[i] = error if error is not None else result
        if len(results) == len(histories):
            done.set()

    for i, h in enumerate(histories):
        grpc.async_infer("bert4rec_batching", make_inputs(grpcclient, h), callback=lambda result, error, i=i: callback(i, result, error))
    assert done.wait(60), f"only {len(results)} of {len(histories)} answers arrived"
    for i, (ids, scores) in enumerate(expected):
        r = results[i]
        assert not isinstance(r, Exception), f"request {i}: {r}"
        got_ids, got_scores = top(r)
        assert got_ids == ids, f"history {i} (length {len(histories[i])}) got another user's answer"
        np.testing.assert_array_equal(np.float32(got_scores), np.float32(scores))

    after = grpc.get_inference_statistics("bert4rec_batching", as_json=True)
    def batches(stats):
        return {int(b["batch_size"]): int(b["compute_infer"].get("count", 0)) for b in stats["model_stats"][0].get("batch_stats", [])}
    grown = {size: n - batches(before).get(size, 0) for size, n in batches(after).items()}
    assert sum(grown.values()) > 0
    assert max(size for size, n in grown.items() if n > 0) > 1, f"no batch of more than one request: {grown}"
    # The backend's timestamps are on Triton's clock: queue and compute times are plausible.
    stats = after["model_stats"][0]["inference_stats"]
    for phase in ["queue", "compute_infer"]:
        mean_ns = int(stats[phase]["ns"]) / max(int(stats[phase]["count"]), 1)
        assert 0 < mean_ns < 5e9, f"mean {phase} time {mean_ns} ns is not plausible"


def expect_error(call, status_http=None, needle=""):
    with pytest.raises(InferenceServerException) as info:
        call()
    message = info.value.message()
    assert needle in message, message
    if status_http is not None:
        assert str(info.value.status()) in {str(status_http), f"StatusCode.{status_http}"}, info.value.status()
    return message


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_requests_get_clear_errors_and_the_server_stays_ready(protocol, server, http, grpc):
    client, module = (http, httpclient) if protocol == "http" else (grpc, grpcclient)
    invalid = "400" if protocol == "http" else "INVALID_ARGUMENT"
    # k < 1 (K = 0 is for asking the USER_EMBEDDING output alone; this client names no outputs, so asks for all)
    expect_error(lambda: client.infer("bert4rec", make_inputs(module, [10011403], k=0)), invalid, "K = 0 asks for no items")
    # wrong dtype (Triton rejects it before the backend; the message names the input)
    bad = module.InferInput("ITEM_IDS", [1, 2], "FP32")
    bad.set_data_from_numpy(np.array([[1.0, 2.0]], dtype=np.float32))
    expect_error(lambda: client.infer("bert4rec", [bad]), invalid, "ITEM_IDS")
    # wrong shape: a 3-D history
    bad = module.InferInput("ITEM_IDS", [1, 1, 2], "INT64")
    bad.set_data_from_numpy(np.array([[[1, 2]]], dtype=np.int64))
    expect_error(lambda: client.infer("bert4rec", [bad]), invalid, "ITEM_IDS")
    # missing ITEM_IDS
    expect_error(lambda: client.infer("bert4rec", make_inputs(module, [1], k=3)[1:]), invalid, "ITEM_IDS")
    # malformed string id (not UTF-8)
    expect_error(
        lambda: client.infer("bert4rec_str", make_inputs(module, [b"\xff\xfe"], strings=True)),
        invalid, "not valid UTF-8",
    )
    # unknown ids under unknown_item_policy=error
    expect_error(lambda: client.infer("bert4rec_strict", make_inputs(module, [10011403, 123])), invalid, "unknown")
    # beyond the default limits (max_k 1000, max_history_length 10000)
    expect_error(lambda: client.infer("bert4rec", make_inputs(module, [10011403], k=5000)), invalid, "more than max_k 1000")
    expect_error(lambda: client.infer("bert4rec", make_inputs(module, [10011403] * 10_001)), invalid, "max_history_length 10000")
    assert server.is_ready()
    ids, _ = top(client.infer("bert4rec", make_inputs(module, [10011403])))
    assert len(ids) == 10


def test_a_bad_request_does_not_fail_its_batch(grpc, predict):
    good = [[10011403, 10011207], [10011739], [10011403, 10011844, 10011305]] * 6
    expected = predict("bert4rec_strict", good, 10)
    results, done = {}, threading.Event()
    total = len(good) * 2

    def callback(key, result, error):
        results[key] = (result, error)
        if len(results) == total:
            done.set()

    for i, h in enumerate(good):
        grpc.async_infer("bert4rec_strict", make_inputs(grpcclient, h), callback=lambda result, error, i=i: callback(("good", i), result, error))
        # Interleaved bad ones: an unknown id (refused by policy) and k = 0, both reach the backend.
        bad = make_inputs(grpcclient, [10011403, 99]) if i % 2 else make_inputs(grpcclient, [10011403], k=0)
        grpc.async_infer("bert4rec_strict", bad, callback=lambda result, error, i=i: callback(("bad", i), result, error))
    assert done.wait(60)
    for i, (ids, _) in enumerate(expected):
        result, error = results[("good", i)]
        assert error is None, error
        assert top(result)[0] == ids
        assert results[("bad", i)][1] is not None


@pytest.mark.parametrize(
    "model,needle",
    [
        ("missing_engine", "manifest.json"),
        ("corrupted_engine", "checksum mismatch"),
        ("future_format", "format version 99 is not supported"),
        ("bad_parameter", "top_k must be a positive integer"),
        ("contradicting", "must be TYPE_STRING"),
        ("gpu_instance", "GPU"),
        ("engine_too_big", "more than the limit of 4096"),
        ("popular_without_list", "convert it with --interactions"),
        ("bert4rec_prefix_cache", "the prefix cache serves GRU4Rec"),
    ],
)
def test_load_errors_are_clear_and_leave_the_server_serving(model, needle, server, http):
    assert model in BROKEN_MODELS
    message = expect_error(lambda: http.load_model(model), None, "")
    assert needle in message, message
    assert not http.is_model_ready(model)
    assert server.is_live()
    ids, _ = top(http.infer("vaecf", make_inputs(httpclient, [10011403])))
    assert len(ids) == 10
    # Healthy: live, and the models that loaded stay ready. (Triton's strict readiness reports the
    # whole server not ready once any load failed; that is the server's policy, not the backend's.)
    assert all(http.is_model_ready(m) for m in ["bert4rec", "vaecf"])


@pytest.mark.parametrize("minimal,full", [("minimal", "bert4rec"), ("gru4rec_minimal", "gru4rec")])
def test_auto_complete_fills_a_minimal_config(http, minimal, full):
    config = http.get_model_config(minimal)
    names = {i["name"]: i for i in config["input"]}
    assert set(names) == {"ITEM_IDS", "K", "EXCLUDE_ITEM_IDS", "CANDIDATE_ITEM_IDS", "INCLUDE_ITEM_SETS",
                          "EXCLUDE_ITEM_SETS"}
    assert names["INCLUDE_ITEM_SETS"]["data_type"] == "TYPE_STRING" and names["INCLUDE_ITEM_SETS"]["optional"]
    assert names["CANDIDATE_ITEM_IDS"]["optional"] and names["CANDIDATE_ITEM_IDS"]["allow_ragged_batch"]
    assert names["ITEM_IDS"]["data_type"] == "TYPE_INT64" and names["ITEM_IDS"]["allow_ragged_batch"]
    outputs = {o["name"]: o for o in config["output"]}
    assert set(outputs) == {"TOP_ITEM_IDS", "TOP_SCORES", "USER_EMBEDDING"}
    # BERT4Rec's hidden size (GRU4Rec's embedding size), 64, plus the 1 that carries the item bias.
    assert [int(d) for d in outputs["USER_EMBEDDING"]["dims"]] == [65]
    assert outputs["USER_EMBEDDING"]["data_type"] == "TYPE_FP32"
    a, _ = top(http.infer(minimal, make_inputs(httpclient, [10011403, 10011207], k=7)))
    b, _ = top(http.infer(full, make_inputs(httpclient, [10011403, 10011207], k=7)))
    assert a == b


def test_two_instances_share_one_engine_and_agree(http):
    a = [top(http.infer("bert4rec_x2", make_inputs(httpclient, [10011403, i]))) for i in (10011207, 10011739, 10011844)]
    b = [top(http.infer("bert4rec", make_inputs(httpclient, [10011403, i]))) for i in (10011207, 10011739, 10011844)]
    assert a == b


def test_custom_metrics_are_published(server, http):
    http.infer("bert4rec", make_inputs(httpclient, [10011403, 5, 6]))  # two unknown ids
    http.infer("bert4rec", make_inputs(httpclient, list(range(10011403, 10011403 + 7 * 60, 7))))  # 60 ids > window
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    def value(name):
        for line in text.splitlines():
            if line.startswith(name + '{') and 'model="bert4rec"' in line:
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} for bert4rec not in the metrics:\n{text[:2000]}")
    assert value("recsys_unknown_item_ids_total") >= 2
    assert value("recsys_histories_truncated_total") >= 1
    assert value("recsys_engine_batch_size_count") >= 2


def test_a_screened_engine_answers_as_the_plain_one_and_reports_its_survivors(server, http):
    """--screen int8 through Triton: the same ids and scores as the plain fp32 engine, bit for bit, and
    one recsys_screen_survivors observation per whole-catalogue history (candidate rows are not
    screened)."""
    def metrics():
        text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("recsys_screen_survivors_") and 'model="vaecf_screened"' in line:
                out[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
        return out

    before = metrics()
    cases = golden_cases("multivae")[:12]
    for case in cases:
        screened = top(http.infer("vaecf_screened", make_inputs(httpclient, case["history_ext"], k=100)))
        plain = top(http.infer("vaecf", make_inputs(httpclient, case["history_ext"], k=100)))
        assert screened == plain, f"case {case['case']}"
    # Re-ranking candidates does not go through the screen.
    http.infer("vaecf_screened", make_inputs(httpclient, cases[0]["history_ext"], k=3,
                                             candidates=[t["external"] for t in cases[0]["topk"][:20]]))
    after = metrics()
    count = after["recsys_screen_survivors_count"] - before.get("recsys_screen_survivors_count", 0.0)
    total = after["recsys_screen_survivors_sum"] - before.get("recsys_screen_survivors_sum", 0.0)
    assert count == len(cases)
    # At least k = 100 items survive per history, and far fewer than the 2,000-item catalogue.
    assert 100 * len(cases) <= total < 0.5 * 2000 * len(cases), total


def test_explicit_reload_swaps_without_failed_requests(http, server):
    client = httpclient.InferenceServerClient(server.http_url)
    failures, done_count, stop = [], [0], threading.Event()

    def load():
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline and done_count[0] < 20000:
            try:
                ids, _ = top(client.infer("vaecf", make_inputs(httpclient, [10011403, 10011207])))
                assert len(ids) == 10
            except Exception as e:  # noqa: BLE001  (every failure counts)
                failures.append(repr(e))
            done_count[0] += 1

    worker = threading.Thread(target=load)
    worker.start()
    try:
        time.sleep(0.3)
        for _ in range(3):
            http.load_model("vaecf")  # reload in place
            time.sleep(0.3)
    finally:
        stop.set()
        worker.join(30)
    assert done_count[0] > 20
    assert failures == [], failures[:5]


def test_a_panic_in_execute_answers_internal_and_the_server_keeps_serving(server, http):
    message = expect_error(
        lambda: http.infer("bert4rec", make_inputs(httpclient, [10011403, PANIC_TRIGGER_ID])),
        "500", "panic trigger",
    )
    assert "failed while executing" in message
    assert server.is_live() and http.is_model_ready("bert4rec")
    ids, _ = top(http.infer("bert4rec", make_inputs(httpclient, [10011403])))
    assert len(ids) == 10


def test_a_panic_while_writing_a_response_fails_that_response_alone(server, http):
    message = expect_error(
        lambda: http.infer("bert4rec", make_inputs(httpclient, [10011403, PANIC_IN_OUTPUT_TRIGGER_ID])),
        "500", "panic trigger in output writing",
    )
    assert "failed while writing this response" in message
    # Sent together to the model with a 20 ms batching window, so that they share an Execute: only
    # the request that panics fails; every other one gets its answer, and the server keeps serving.
    history = [10011403, 10011407]
    pending = [
        http.async_infer("bert4rec_batching", make_inputs(httpclient, history + ([PANIC_IN_OUTPUT_TRIGGER_ID] if i == 3 else [])))
        for i in range(8)
    ]
    want, _ = top(http.infer("bert4rec_batching", make_inputs(httpclient, history)))
    for i, request in enumerate(pending):
        if i == 3:
            with pytest.raises(InferenceServerException) as info:
                request.get_result()
            assert "panic trigger in output writing" in info.value.message()
        else:
            ids, _ = top(request.get_result())
            assert ids == want, i
    assert server.is_live() and http.is_model_ready("bert4rec")
    ids, _ = top(http.infer("bert4rec", make_inputs(httpclient, [10011403])))
    assert len(ids) == 10


def test_the_server_log_names_each_screened_model_s_plan(server):
    """A screened engine's plan (measured at load on this CPU, or read from its file) is logged,
    and so is the thread plan of a model of more than one thread."""
    log = server.log()
    assert "model vaecf_screened version 1: screen plan: batch 1+: int8 screen — pinned (always)" in log, log[-3000:]
    assert "batch 64+:" in log
    assert re.search(r"model vaecf_screened version 1: thread plan: batch 1\+: [12] threads? \(", log), log[-3000:]
    # A model of one thread has nothing to plan.
    assert "model vaecf version 1: thread plan" not in log
    # AVX-512 kernels come in two row blocks, planned for every model; other kernels have one.
    flags = open("/proc/cpuinfo").read()
    if all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")):
        assert re.search(r"model vaecf version 1: row-block plan: row groups of up to [48] rows \(batch 8: ", log), \
            log[-3000:]
    else:
        assert "row-block plan" not in log
