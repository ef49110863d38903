"""The prefix cache through a real tritonserver and the Python package: the fixture's test users
replayed event by event (every call carries the whole history, one event longer each time) are
answered by GRU4Rec and SASRec with their prefix caches (on by default) exactly as without them (a
second model on the same engine with prefix_cache_bytes 0), and equal RecBole's golden answers at
the final event of the golden histories; the Prometheus counters show the events reused; the
Python package's timelines answer every prefix as its own call does."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient

import recsys
from conftest import FIXTURES, golden_cases
from test_serving import make_inputs


def fixture_users(count: int) -> list[list[int]]:
    lines = (FIXTURES / "test_set.tsv").read_text().splitlines()[1:count + 1]
    return [[int(x) for x in line.split("\t")[2].split()] for line in lines]


def metric(server, name: str, model: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") and f'model="{model}"' in line:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for {model}")


CAUSAL = [("gru4rec", 64 << 20), ("sasrec", 256 << 20)]


@pytest.mark.parametrize("model,budget", CAUSAL)
def test_replayed_sessions_are_answered_as_without_the_cache(server, http, model, budget):
    reused_before = metric(server, "recsys_prefix_cache_events_reused_total", model)
    events = 0
    for user, history in enumerate(fixture_users(6)):
        for t in range(1, min(len(history), 60) + 1):
            inputs = make_inputs(httpclient, history[:t], k=20)
            cached = http.infer(model, inputs)
            plain = http.infer(f"{model}_nocache", inputs)
            assert cached.as_numpy("TOP_ITEM_IDS").tolist() == plain.as_numpy("TOP_ITEM_IDS").tolist(), (user, t)
            np.testing.assert_array_equal(cached.as_numpy("TOP_SCORES"), plain.as_numpy("TOP_SCORES"))
            events += 1
    reused = metric(server, "recsys_prefix_cache_events_reused_total", model) - reused_before
    # Every call after a user's first extends the previous one (within the window of 50 events).
    assert reused > events, (reused, events)
    assert metric(server, "recsys_prefix_cache_hits_total", model) > 0
    assert 0 < metric(server, "recsys_prefix_cache_bytes", model) <= budget


@pytest.mark.parametrize("model", [m for m, _ in CAUSAL])
def test_golden_histories_replayed_end_on_recbole_s_answer(http, model):
    """RecBole's golden top-10 (seen items already left out) at the final event of each golden
    history replayed one event at a time: each position's score within 5e-5 of RecBole's float64
    one (two items RecBole scores within that may trade places), the same set of items."""
    checked = 0
    for case in golden_cases(model):
        if case.get("topk") is None:
            continue
        # The known items one at a time, then the raw history (its unknown ids are dropped, so it
        # maps onto the last prefix and resumes from it).
        known = case["effective_history_ext"]
        history = case["history_ext"]
        for t in range(1, len(known)):
            http.infer(model, make_inputs(httpclient, known[:t], k=10))
        result = http.infer(model, make_inputs(httpclient, history, k=10))
        ids = result.as_numpy("TOP_ITEM_IDS")[0].tolist()
        scores = result.as_numpy("TOP_SCORES")[0]
        golden = case["topk"][:10]
        np.testing.assert_allclose(scores, [g["score"] for g in golden], atol=5e-5, rtol=0)
        tied_at_the_end = abs(golden[9]["score"] - case["topk"][10]["score"]) < 1e-4
        if not tied_at_the_end:
            assert set(ids) == {g["external"] for g in golden}, case["case"]
        plain = http.infer(f"{model}_nocache", make_inputs(httpclient, history, k=10))
        assert ids == plain.as_numpy("TOP_ITEM_IDS")[0].tolist()
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("model", [m for m, _ in CAUSAL])
def test_the_python_package_replays_with_the_same_answers(repository, model):
    engine_dir = str(repository / model / "1")
    cached = recsys.Engine(engine_dir, threads=1, prefix_cache_bytes=8 << 20)
    plain = recsys.Engine(engine_dir, threads=1)
    assert plain.prefix_cache_stats is None
    for history in fixture_users(4):
        for t in range(1, min(len(history), 40) + 1):
            a_ids, a_scores = cached.recommend([history[:t]], k=20)
            b_ids, b_scores = plain.recommend([history[:t]], k=20)
            assert a_ids.tolist() == b_ids.tolist()
            np.testing.assert_array_equal(a_scores, b_scores)
    stats = cached.prefix_cache_stats
    assert stats["hits"] > 0 and stats["events_reused"] > stats["events_computed"], stats
    with pytest.raises(ValueError, match="serves GRU4Rec, SASRec and HSTU"):
        recsys.Engine(str(repository / "bert4rec" / "1"), prefix_cache_bytes=1 << 20)


@pytest.mark.parametrize("model", [m for m, _ in CAUSAL] + ["bert4rec"])
def test_timelines_answer_each_prefix_as_its_own_call(repository, model):
    """`Engine.timelines`: event t of each history answers its first t ids exactly as `predict`
    does on its own; with the cache each step computes one event per history (within the window),
    so n events cost n steps, not n(n+1)/2."""
    engine_dir = str(repository / model / "1")
    histories = [h[:45] for h in fixture_users(5)]
    histories[1] = [-5] + histories[1]  # an unknown id first: event 1 has no known item (an
    # error for the causal models, BERT4Rec's empty-history answer for BERT4Rec, as predict gives)
    reference = recsys.Engine(engine_dir, threads=1)
    carries = model != "bert4rec"
    engine = recsys.Engine(engine_dir, threads=1, prefix_cache_bytes=(8 << 20) if carries else 0)
    timelines = engine.timelines(histories, k=15)
    assert len(timelines) == len(histories)
    for history, (ids, scores, errors) in zip(histories, timelines):
        assert len(ids) == len(scores) == len(errors) == len(history)
        want_ids, want_scores, _, want_errors = reference.predict(
            [history[:t] for t in range(1, len(history) + 1)], default_k=15)
        assert errors == want_errors
        for t in range(len(history)):
            assert ids[t].tolist() == want_ids[t].tolist(), (model, t)
            np.testing.assert_array_equal(scores[t], want_scores[t])
    if carries:
        stats = engine.prefix_cache_stats
        known_events = sum(len(h) for h in histories) - 1
        # One event computed per history per step, plus the step after the unknown id (which
        # had nothing to resume from); SASRec recomputes nothing else.
        assert stats["events_computed"] <= known_events + len(histories), stats
