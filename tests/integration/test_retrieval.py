"""Retrieval and ranking through the real tritonserver: the USER_EMBEDDING output against the item
table of `recsys export-items` and a real FAISS index, and one Execute batch mixing whole-catalogue,
candidate and embedding requests with bad ones, each answered on its own."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import golden_cases
from test_serving import expect_error, make_inputs, top

# The served embedding . an exported row is the model's score up to f32 summation order.
SCORE_ABS_TOL = 1e-4
# PyTorch's golden scores against the engine's (the same tolerance the candidate test uses).
GOLDEN_ABS_TOL = 5e-5


@pytest.fixture(scope="module")
def item_table(recsys_bin, repository, tmp_path_factory):
    """`recsys export-items` of a served model: (rows [N, d + 1], external ids as strings)."""
    out = tmp_path_factory.mktemp("items")
    tables = {}

    def export(model: str):
        if model not in tables:
            subprocess.run([str(recsys_bin), "export-items", "--engine", str(repository / model / "1"),
                            "--output", str(out / model)], check=True, capture_output=True)
            tables[model] = (np.load(out / f"{model}.npy"),
                             (out / f"{model}.ids.txt").read_text().split("\n")[:-1])
        return tables[model]

    return export


def outputs(module, *names):
    return [module.InferRequestedOutput(n) for n in names]


@pytest.mark.parametrize("model,model_dir,width", [("bert4rec_emb", "bert4rec", 65), ("vaecf_emb", "multivae", 601),
                                                   ("sasrec_emb", "sasrec", 65), ("gru4rec_emb", "gru4rec", 65)])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_user_embedding_scores_items_as_the_model_does(model, model_dir, width, protocol, http, grpc,
                                                           item_table):
    client, module = (http, httpclient) if protocol == "http" else (grpc, grpcclient)
    table, ids = item_table(model)
    if model_dir in ("sasrec", "gru4rec"):
        # Scores are the bare dot product: the bias column says so.
        assert not table[:, -1].any()
    row_of = {external: r for r, external in enumerate(ids)}
    for case in golden_cases(model_dir)[:8]:
        both = client.infer(model, make_inputs(module, case["history_ext"], k=100),
                            outputs=outputs(module, "TOP_ITEM_IDS", "TOP_SCORES", "USER_EMBEDDING"))
        user = both.as_numpy("USER_EMBEDDING")
        assert user.shape == (1, width) and user.dtype == np.float32
        assert user[0, -1] == 1.0
        got_ids, got_scores = top(both)
        assert got_ids == [t["external"] for t in case["topk"]], f"case {case['case']}"
        # Its inner product with the exported rows is each returned item's score, and PyTorch's.
        rows = table[[row_of[str(i)] for i in got_ids]]
        np.testing.assert_allclose(rows @ user[0], got_scores, atol=SCORE_ABS_TOL)
        np.testing.assert_allclose(rows @ user[0], [t["score"] for t in case["topk"]], atol=GOLDEN_ABS_TOL)
        # The embedding alone (nothing scored), with or without K = 0: the same vector, no TOP_*.
        for k in (0, None):
            alone = client.infer(model, make_inputs(module, case["history_ext"], k=k),
                                 outputs=outputs(module, "USER_EMBEDDING"))
            np.testing.assert_array_equal(alone.as_numpy("USER_EMBEDDING"), user)
            assert alone.as_numpy("TOP_ITEM_IDS") is None and alone.as_numpy("TOP_SCORES") is None
    # The plain contract is unchanged: naming the ranked outputs gets no embedding.
    plain = client.infer(model, make_inputs(module, [10011403], k=5),
                         outputs=outputs(module, "TOP_ITEM_IDS", "TOP_SCORES"))
    assert plain.as_numpy("USER_EMBEDDING") is None and len(top(plain)[0]) == 5


def test_the_demo_configs_send_only_the_ranking_to_a_client_that_names_no_outputs(server):
    """The README's curl example: a request naming no outputs gets every output the config
    declares, and the demo configs declare the ranking alone (USER_EMBEDDING is a line to
    uncomment); the same model with that line sends the embedding too."""
    import requests

    body = {"inputs": [{"name": "ITEM_IDS", "datatype": "INT64", "shape": [1, 2], "data": [10011403, 10011207]}]}
    for model, width in [("bert4rec", 65), ("vaecf", 601), ("sasrec", 65), ("gru4rec", 65)]:
        plain = requests.post(f"http://{server.http_url}/v2/models/{model}/infer", json=body, timeout=30)
        assert plain.status_code == 200, plain.text
        assert {o["name"] for o in plain.json()["outputs"]} == {"TOP_ITEM_IDS", "TOP_SCORES"}
        with_embedding = requests.post(f"http://{server.http_url}/v2/models/{model}_emb/infer", json=body, timeout=30)
        outputs = {o["name"]: o for o in with_embedding.json()["outputs"]}
        assert set(outputs) == {"TOP_ITEM_IDS", "TOP_SCORES", "USER_EMBEDDING"}
        assert outputs["USER_EMBEDDING"]["shape"] == [1, width]


def test_faiss_over_the_exported_items_queried_with_served_embeddings_returns_the_served_top100(grpc, item_table):
    """Retrieval as a deployment runs it: the embeddings come from the server, the index is a real
    exact inner-product index (FAISS IndexFlatIP), the history is left out afterwards."""
    import faiss

    for model, model_dir in [("bert4rec_emb", "bert4rec"), ("vaecf_emb", "multivae"), ("sasrec_emb", "sasrec"),
                             ("gru4rec_emb", "gru4rec")]:
        table, ids = item_table(model)
        index = faiss.IndexFlatIP(table.shape[1])
        index.add(table)
        cases = golden_cases(model_dir)[:32]
        same = 0
        for case in cases:
            result = grpc.infer(model, make_inputs(grpcclient, case["history_ext"], k=100),
                                outputs=outputs(grpcclient, "TOP_ITEM_IDS", "TOP_SCORES", "USER_EMBEDDING"))
            want_ids, want_scores = top(result)
            seen = {str(i) for i in case["history_ext"]}
            scores, rows = index.search(result.as_numpy("USER_EMBEDDING"), 100 + len(seen))
            hits = [(ids[r], s) for r, s in zip(rows[0], scores[0]) if ids[r] not in seen][:100]
            assert len(hits) == len(want_ids) == 100
            for (got_id, got_score), want_id, want_score in zip(hits, want_ids, want_scores):
                assert abs(got_score - want_score) <= SCORE_ABS_TOL, (model, got_id, want_id)
                same += got_id == str(want_id)
        # Only items within the tolerance of each other may change places.
        assert same >= 0.999 * 100 * len(cases), (model, same)


@pytest.mark.parametrize("name", ["bert4rec", "sasrec", "gru4rec"])
def test_one_execute_mixes_every_kind_of_request_and_refusal(grpc, server, name):
    """<name>_mixed batches whatever arrives within 20 ms, refuses unknown ids and declares
    USER_EMBEDDING: every request below is sent at once, so they share Execute calls (ragged
    histories of every length, whole-catalogue, candidate and embedding rows together)."""
    model = f"{name}_mixed"
    cases = [c for c in golden_cases(name) if not c["unknown_ext"] and c["topk"]][:6]
    all_outputs = ("TOP_ITEM_IDS", "TOP_SCORES", "USER_EMBEDDING")
    # The reference answers, each request alone.
    alone_user = {}
    for i, case in enumerate(cases):
        r = grpc.infer(model, make_inputs(grpcclient, case["history_ext"]), outputs=outputs(grpcclient, "USER_EMBEDDING"))
        alone_user[i] = r.as_numpy("USER_EMBEDDING")

    requests: dict[tuple, tuple] = {}
    for i, case in enumerate(cases):
        h = case["history_ext"]
        top100 = case["topk"]
        picked = [top100[j]["external"] for j in (60, 5, 40, 20)]
        requests[("whole", i)] = (make_inputs(grpcclient, h, k=100), all_outputs[:2])
        requests[("candidates", i)] = (make_inputs(grpcclient, h, k=3, candidates=picked), all_outputs[:2])
        requests[("embedding", i)] = (make_inputs(grpcclient, h, k=0), all_outputs[2:])
        requests[("both", i)] = (make_inputs(grpcclient, h, k=7), all_outputs)
    # Refusals, each naming its input; the backend sees all but the type mismatch (Triton's own check).
    requests[("bad", "k0")] = (make_inputs(grpcclient, cases[0]["history_ext"], k=0), all_outputs)
    requests[("bad", "too_many")] = (make_inputs(grpcclient, [10011403], candidates=list(range(1, 10_002))), all_outputs[:2])
    requests[("bad", "unknown_candidate")] = (make_inputs(grpcclient, [10011403], candidates=[10011445, -5]), all_outputs[:2])
    string_candidates = grpcclient.InferInput("CANDIDATE_ITEM_IDS", [1, 1], "BYTES")
    string_candidates.set_data_from_numpy(np.array([[b"10011445"]], dtype=np.object_))
    requests[("bad", "type")] = (make_inputs(grpcclient, [10011403]) + [string_candidates], all_outputs[:2])
    needles = {
        "k0": "K = 0 asks for no items",
        "too_many": "CANDIDATE_ITEM_IDS holds 10001 ids per history, more than max_candidates 10000",
        "unknown_candidate": "CANDIDATE_ITEM_IDS holds 1 id(s) unknown to the model",
        "type": "CANDIDATE_ITEM_IDS",
    }

    before = grpc.get_inference_statistics(model, as_json=True)
    results, done = {}, threading.Event()

    def callback(key, result, error):
        results[key] = (result, error)
        if len(results) == len(requests):
            done.set()

    for key, (inputs, names) in requests.items():
        grpc.async_infer(model, inputs, outputs=outputs(grpcclient, *names),
                         callback=lambda result, error, key=key: callback(key, result, error))
    assert done.wait(60), f"only {len(results)} of {len(requests)} answers arrived"

    for i, case in enumerate(cases):
        top100 = case["topk"]
        for kind in ("whole", "candidates", "embedding", "both"):
            assert results[(kind, i)][1] is None, (kind, i, results[(kind, i)][1])
        ids, scores = top(results[("whole", i)][0])
        assert ids == [t["external"] for t in top100], f"case {case['case']}"
        np.testing.assert_allclose(scores, [t["score"] for t in top100], atol=GOLDEN_ABS_TOL)
        ids, scores = top(results[("candidates", i)][0])
        assert ids == [top100[j]["external"] for j in (5, 20, 40)], f"case {case['case']}"
        np.testing.assert_allclose(scores, [top100[j]["score"] for j in (5, 20, 40)], atol=GOLDEN_ABS_TOL)
        embedding_only = results[("embedding", i)][0]
        assert embedding_only.as_numpy("TOP_ITEM_IDS") is None
        np.testing.assert_allclose(embedding_only.as_numpy("USER_EMBEDDING"), alone_user[i], atol=1e-6)
        both = results[("both", i)][0]
        assert top(both)[0] == [t["external"] for t in top100[:7]]
        np.testing.assert_allclose(both.as_numpy("USER_EMBEDDING"), alone_user[i], atol=1e-6)
    for name, needle in needles.items():
        _, error = results[("bad", name)]
        assert error is not None, name
        assert needle in error.message(), (name, error.message())
        assert "INVALID_ARGUMENT" in str(error.status()), (name, error.status())

    after = grpc.get_inference_statistics(model, as_json=True)
    def counts(stats):
        s = stats["model_stats"][0]
        return int(s["inference_count"]), int(s["execution_count"])
    (inf0, exe0), (inf1, exe1) = counts(before), counts(after)
    assert exe1 - exe0 < inf1 - inf0, f"no Execute call held more than one request: {inf1 - inf0} in {exe1 - exe0}"
    assert server.is_ready()


def test_the_retrieve_then_rank_example_runs_as_written(server, grpc, item_table, repository, tmp_path):
    """examples/retrieve_then_rank.py against the served demo models (the retriever with its
    USER_EMBEDDING line uncommented, as the README says): the ranked items come from the retrieved
    pool, exactly as the ranker ranks that pool when asked directly."""
    import sys

    table, _ = item_table("vaecf_emb")
    prefix = tmp_path / "items"
    np.save(f"{prefix}.npy", table)
    (tmp_path / "items.ids.txt").write_text("\n".join(item_table("vaecf_emb")[1]) + "\n")
    histories = [case["history_ext"] for case in golden_cases("bert4rec")[:3] if not case["unknown_ext"]]
    cmd = [sys.executable, "examples/retrieve_then_rank.py", "--grpc", server.grpc_url, "--items", str(prefix),
           "--retriever", "vaecf_emb", "--ranker", "bert4rec", "--candidates", "150", "--k", "10"]
    for h in histories:
        cmd += ["--history", *map(str, h)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr
    answers = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(answers) == len(histories)
    for history, answer in zip(histories, answers):
        assert len(answer["candidates"]) == 150 and not set(answer["candidates"]) & set(history)
        assert set(answer["item_ids"]) <= set(answer["candidates"]) and len(answer["item_ids"]) == 10
        direct = grpc.infer("bert4rec", make_inputs(grpcclient, history, k=10, candidates=answer["candidates"]),
                            outputs=outputs(grpcclient, "TOP_ITEM_IDS", "TOP_SCORES"))
        assert top(direct)[0] == answer["item_ids"]


def ensemble_inputs(module, history, *, k=None, candidate_count=None, exclude=None):
    inputs = make_inputs(module, history, k=k, exclude=exclude)
    if candidate_count is not None:
        t = module.InferInput("CANDIDATE_COUNT", [1, 1], "INT32")
        t.set_data_from_numpy(np.array([[candidate_count]], dtype=np.int32))
        inputs.append(t)
    return inputs


def by_hand(client, module, history, *, k=None, candidate_count=None, exclude=None):
    """The two calls the ensemble replaces: VAE-CF's candidates, then BERT4Rec ranking exactly those."""
    retrieved = client.infer("vaecf_candidates", make_inputs(module, history, k=candidate_count, exclude=exclude),
                             outputs=outputs(module, "TOP_ITEM_IDS"))
    candidates = retrieved.as_numpy("TOP_ITEM_IDS")[0].tolist()
    ranked = client.infer("bert4rec", make_inputs(module, history, k=k, exclude=exclude, candidates=candidates),
                          outputs=outputs(module, "TOP_ITEM_IDS", "TOP_SCORES"))
    return candidates, top(ranked)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_retrieve_and_rank_ensemble_answers_in_one_call_what_two_calls_answer(protocol, http, grpc, server):
    """The demo repository's `retrieve_and_rank` (model_repository/retrieve_and_rank): VAE-CF's 500
    best items re-ranked by BERT4Rec inside the server. Its answer is, bit for bit, the answer of the
    two requests made by hand, with and without each optional input."""
    client, module = (http, httpclient) if protocol == "http" else (grpc, grpcclient)
    cases = [c for c in golden_cases("bert4rec") if not c["unknown_ext"]][:12]
    variants = [{}, {"k": 25}, {"candidate_count": 40}, {"k": 5, "candidate_count": 8}]
    for n, case in enumerate(cases):
        history = case["history_ext"]
        options = dict(variants[n % len(variants)])
        if n % 3 == 2:
            options["exclude"] = case["history_ext"][:1] + [10011403]
        candidates, (want_ids, want_scores) = by_hand(client, module, history, **options)
        assert len(candidates) == options.get("candidate_count", 500)
        answer = client.infer("retrieve_and_rank", ensemble_inputs(module, history, **options))
        got_ids, got_scores = top(answer)
        assert got_ids == want_ids, (n, options)
        assert got_scores == want_scores, (n, options)
        assert len(got_ids) == min(options.get("k", 10), len(candidates))
        assert set(got_ids) <= set(candidates)
        assert not set(got_ids) & set(options.get("exclude", []))
    assert server.is_ready()


def test_the_ensemble_answers_concurrent_requests_each_as_asked(http, server):
    """32 requests in flight at once (the composing models batch them): each answer is its own
    history's, as the two calls give it."""
    cases = [c for c in golden_cases("bert4rec") if not c["unknown_ext"]][:32]
    pending = [http.async_infer("retrieve_and_rank", ensemble_inputs(httpclient, c["history_ext"], k=10))
               for c in cases]
    answers = [top(p.get_result()) for p in pending]
    for case, answer in zip(cases, answers):
        _, want = by_hand(http, httpclient, case["history_ext"], k=10)
        assert answer == want
    assert server.is_ready()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_bad_ensemble_request_gets_the_stage_s_error_and_the_server_keeps_serving(protocol, http, grpc, server):
    """A stage's refusal comes back through the ensemble, in the stage's own words (the retriever
    calls its CANDIDATE_COUNT K, as the config's comment says)."""
    client, module = (http, httpclient) if protocol == "http" else (grpc, grpcclient)
    invalid = "400" if protocol == "http" else "INVALID_ARGUMENT"
    # Too many candidates asked of the retriever (its max_k is 1,000).
    message = expect_error(lambda: client.infer("retrieve_and_rank",
                                                ensemble_inputs(module, [10011403], candidate_count=5000)), invalid)
    assert "in ensemble 'retrieve_and_rank'" in message and "K = 5000 is more than max_k 1000" in message, message
    # Too many ranked items asked of the ranker.
    message = expect_error(lambda: client.infer("retrieve_and_rank", ensemble_inputs(module, [10011403], k=5000)),
                           invalid)
    assert "in ensemble 'retrieve_and_rank'" in message and "K = 5000 is more than max_k 1000" in message, message
    # The server goes on answering.
    assert top(client.infer("retrieve_and_rank", ensemble_inputs(module, [10011403, 10011207])))[0]
    assert server.is_ready()
