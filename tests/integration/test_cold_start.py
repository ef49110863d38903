"""Visitors without history through a real tritonserver: under empty_history_policy the
popularity list (recsys convert --interactions) answers histories that are empty or hold no known
item, SASRec included, filtered like any answer and counted in the popular_answers response
parameter; the reference counts the interaction log here."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import ROOT, demo_attributes, read_attributes
from test_filters import set_names
from test_serving import expect_error, make_inputs


def popularity(catalogue: set[int]) -> list[tuple[int, int]]:
    """(item, count) most frequent first, from the demo log; ties by the catalogue's internal order
    (the item map's order)."""
    log = (ROOT / "build" / "demo-attributes" / "interactions.inter").read_text().splitlines()[1:]
    counts = Counter(int(line.split("\t")[1]) for line in log)
    order = [int(l.split("\t")[1]) for l in (ROOT / "tests" / "fixtures" / "sasrec" / "item_id_map.tsv")
             .read_text().splitlines()[1:]]
    rank = {item: i for i, item in enumerate(order)}
    return sorted(((i, c) for i, c in counts.items() if i in catalogue), key=lambda t: (-t[1], rank[t[0]]))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", ["sasrec_cold", "vaecf_cold"])
def test_visitors_without_history_get_the_most_popular_items_filtered(model, protocol, http, grpc, server):
    client, module = (http, httpclient) if protocol == "http" else (grpc, grpcclient)
    sets = read_attributes(demo_attributes("sasrec"))
    catalogue = set().union(*sets.values())
    ranked = popularity(catalogue)
    total = sum(c for _, c in ranked)
    for history in ([], [-1, -2]):  # empty, and only unknown ids
        excluded = [ranked[0][0]]
        result = client.infer(model, make_inputs(module, history, k=10, exclude=excluded))
        ids = result.as_numpy("TOP_ITEM_IDS")[0].tolist()
        assert ids == [i for i, _ in ranked[1:11]]
        np.testing.assert_allclose(result.as_numpy("TOP_SCORES")[0], [c / total for _, c in ranked[1:11]], rtol=1e-6)
        if protocol == "http":
            assert result.get_response()["parameters"]["popular_answers"] == 1
        shoes = sets["category=shoes"]
        inputs = make_inputs(module, history, k=5) + [set_names(module, "INCLUDE_ITEM_SETS", [["category=shoes"]])]
        ids = client.infer(model, inputs).as_numpy("TOP_ITEM_IDS")[0].tolist()
        assert ids == [i for i, _ in ranked if i in shoes][:5]
    # A history with a known item is the model's.
    result = client.infer(model, make_inputs(module, [10011403], k=5))
    if protocol == "http":
        assert result.get_response()["parameters"]["popular_answers"] == 0
    assert server.is_live()


def test_the_model_policy_keeps_the_model_s_answer_and_sasrec_without_the_list_refuses(http):
    mult_vae = http.infer("vaecf_cold_model", make_inputs(httpclient, [], k=5))
    assert mult_vae.get_response()["parameters"]["popular_answers"] == 0
    plain = http.infer("vaecf", make_inputs(httpclient, [], k=5))
    assert mult_vae.as_numpy("TOP_ITEM_IDS").tolist() == plain.as_numpy("TOP_ITEM_IDS").tolist()
    expect_error(lambda: http.infer("sasrec", make_inputs(httpclient, [], k=5)), "400", "--interactions")
