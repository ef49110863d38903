"""Item set filters through a real tritonserver: INCLUDE_ITEM_SETS / EXCLUDE_ITEM_SETS with
exclusions, seen items and candidates give exactly a numpy top-k over the model's whole score
vector (the Python package's `score`) masked by the sets read from the attribute table itself;
unknown names are INVALID_ARG naming them; `recsys predict` and `recsys eval` take the same
filters."""

from __future__ import annotations

import json
import random
import subprocess

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import FIXTURES, demo_attributes, golden_cases, read_attributes
from test_serving import expect_error, make_inputs

try:
    import recsys
except ImportError as missing:  # a collection error, not a skip: CI must not pass without the package
    raise ImportError("the recsys Python package is not installed: .venv/bin/pip install ./python "
                      "(scripts/test.sh does)") from missing

CATEGORIES = ["books", "music", "games", "shoes", "hats", "bags", "coats", "toys"]
REGIONS = ["EU", "US", "APAC"]


def set_names(module, name, rows):
    arr = np.array([[n.encode() for n in row] for row in rows], dtype=np.object_)
    t = module.InferInput(name, list(arr.shape), "BYTES")
    t.set_data_from_numpy(arr)
    return t


def random_filter(rng):
    """A shop's filters: a category page (the rarest category among them), several categories in
    a region, the adult-rated items dropped, or both."""
    kind = rng.randrange(5)
    include, exclude = [], []
    if kind == 0:
        include = ["category=toys"]
    elif kind == 1:
        include = [f"category={c}" for c in rng.sample(CATEGORIES, 2)] + [f"region={rng.choice(REGIONS)}"]
    elif kind == 2:
        exclude = ["age_rating=adult"]
    elif kind == 3:
        include = [f"region={rng.choice(REGIONS)}"]
        exclude = ["age_rating=adult", f"category={rng.choice(CATEGORIES)}"]
    else:
        include = [f"category={rng.choice(CATEGORIES)}"]
    return include, exclude


def reference(scores_row, item_ids, sets, include, exclude, excluded, candidates, k):
    """numpy top-k over the full score vector: items kept by the sets (AND across columns, OR
    within one), not excluded, among the candidates; ties to the lower internal index."""
    keep = np.ones(len(item_ids), dtype=bool)
    by_column: dict[str, set[int]] = {}
    for name in include:
        by_column.setdefault(name.split("=")[0], set()).update(sets.get(name, set()))
    for members in by_column.values():
        keep &= np.isin(item_ids, list(members))
    for name in exclude:
        keep &= ~np.isin(item_ids, list(sets.get(name, set())))
    keep &= ~np.isin(item_ids, list(excluded))
    if candidates is not None:
        keep &= np.isin(item_ids, list(candidates))
    index = np.flatnonzero(keep)
    order = np.lexsort((index, -scores_row[index]))[:k]
    return item_ids[index[order]].tolist(), scores_row[index[order]].tolist()


@pytest.mark.parametrize("model,model_dir", [("vaecf", "multivae"), ("vaecf_int8", "multivae"),
                                             ("vaecf_screened", "multivae"), ("bert4rec", "bert4rec"),
                                             ("sasrec", "sasrec"), ("gru4rec", "gru4rec")])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_filtered_answers_are_numpy_s_top_k_over_the_masked_scores(model, model_dir, protocol, http, grpc,
                                                                    repository):
    client, module = (http, httpclient) if protocol == "http" else (grpc, grpcclient)
    engine = recsys.Engine(str(repository / model / "1"), threads=1)
    sets = read_attributes(demo_attributes(model_dir))
    assert set(engine.item_sets) == set(sets), "the engine holds the table's sets"
    item_ids = np.asarray(engine.item_ids)
    rng = random.Random(f"{model}-{protocol}")
    cases = [c for c in golden_cases(model_dir) if c.get("topk", True) is not None][:12]
    for n, case in enumerate(cases):
        history = case["history_ext"]
        include, exclude = random_filter(rng)
        k = [5, 20, 100][n % 3]
        excluded = rng.sample(item_ids.tolist(), 30)
        candidates = rng.sample(item_ids.tolist(), 300) if n % 4 == 3 else None
        inputs = make_inputs(module, history, k=k, exclude=excluded, candidates=candidates)
        if include:
            inputs.append(set_names(module, "INCLUDE_ITEM_SETS", [include]))
        if exclude:
            inputs.append(set_names(module, "EXCLUDE_ITEM_SETS", [exclude]))
        result = client.infer(model, inputs)
        ids = result.as_numpy("TOP_ITEM_IDS")[0].tolist()
        scores = result.as_numpy("TOP_SCORES")[0].tolist()
        scores_row = engine.score([history])[0]
        seen = set(history)
        want_ids, want_scores = reference(scores_row, item_ids, sets, include, exclude, seen | set(excluded),
                                          candidates, k)
        assert ids == want_ids, f"{model} case {n}: include {include} exclude {exclude}"
        np.testing.assert_array_equal(np.float32(scores), np.float32(want_scores))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_unknown_columns_are_invalid_arguments_naming_them_and_the_server_keeps_serving(protocol, http, grpc):
    client, module = (http, httpclient) if protocol == "http" else (grpc, grpcclient)
    invalid = "400" if protocol == "http" else "INVALID_ARGUMENT"
    for name, bad in [("INCLUDE_ITEM_SETS", "colour=red"), ("EXCLUDE_ITEM_SETS", "colour=red"),
                      ("INCLUDE_ITEM_SETS", "shoes")]:
        inputs = make_inputs(module, [10011403], k=5) + [set_names(module, name, [[bad]])]
        expect_error(lambda: client.infer("vaecf", inputs), invalid, bad)
    # A value of a known column that no item has is an empty set, not an error.
    inputs = make_inputs(module, [10011403], k=5) + [set_names(module, "INCLUDE_ITEM_SETS", [["category=boots"]])]
    assert (client.infer("vaecf", inputs).as_numpy("TOP_ITEM_IDS")[0] == -1).all()
    inputs = make_inputs(module, [10011403], k=5) + [set_names(module, "INCLUDE_ITEM_SETS", [["category=toys"]])]
    ids = client.infer("vaecf", inputs).as_numpy("TOP_ITEM_IDS")[0].tolist()
    toys = read_attributes(demo_attributes("multivae"))["category=toys"]
    assert len(ids) == 5 and set(ids) <= toys


def test_predict_and_eval_take_the_same_filters(recsys_bin, repository, tmp_path):
    engine_dir = repository / "vaecf" / "1"
    sets = read_attributes(demo_attributes("multivae"))
    lines = [
        {"item_ids": [10011403, 10011207], "k": 10, "include_item_sets": ["category=shoes", "region=EU"], "user": 1},
        {"item_ids": [10011403], "k": 10, "exclude_item_sets": ["age_rating=adult"], "user": 2},
        {"item_ids": [10011403], "include_item_sets": ["colour=red"], "user": 3},
        # A value of a known column that no item has: an empty set, answered with nothing.
        {"item_ids": [10011403], "include_item_sets": ["category=nope"], "user": 4},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(l) + "\n" for l in lines))
    run = subprocess.run([str(recsys_bin), "predict", "--engine", str(engine_dir), "--input", str(source),
                          "--output", "-"], capture_output=True, text=True)
    assert run.returncode == 3, run.stderr  # one line failed
    out = [json.loads(l) for l in run.stdout.splitlines()]
    first = out[0]["item_ids"]
    assert len(first) == 10 and set(first) <= sets["category=shoes"] & sets["region=EU"]
    assert not set(out[1]["item_ids"]) & sets["age_rating=adult"]
    assert "colour" in out[2]["error"] and out[2]["user"] == 3
    assert out[3]["item_ids"] == [] and out[3]["user"] == 4

    test_set = FIXTURES / "test_set.tsv"
    plain = json.loads(subprocess.run([str(recsys_bin), "eval", "--engine", str(engine_dir), "--test", str(test_set)],
                                      check=True, capture_output=True, text=True).stdout)
    page = json.loads(subprocess.run([str(recsys_bin), "eval", "--engine", str(engine_dir), "--test", str(test_set),
                                      "--include-item-sets", "category=music"],
                                     check=True, capture_output=True, text=True).stdout)
    outside = page["targets_outside_filter"]
    assert 0 < outside < plain["metrics"]["n_users"]
    assert page["metrics"]["n_users"] == plain["metrics"]["n_users"] - outside
    bad = subprocess.run([str(recsys_bin), "eval", "--engine", str(engine_dir), "--test", str(test_set),
                          "--include-item-sets", "colour=nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "colour=nope" in bad.stderr


def test_the_python_package_filters_as_the_server_does(http, repository):
    engine = recsys.Engine(str(repository / "vaecf" / "1"), threads=1)
    histories = [[10011403, 10011207], [10011739]]
    include, exclude = ["category=shoes", "category=hats", "region=EU"], ["age_rating=adult"]
    ids, scores = engine.recommend(histories, k=10, include_sets=include, exclude_sets=exclude)
    for row, history in enumerate(histories):
        inputs = make_inputs(httpclient, history, k=10) + [set_names(httpclient, "INCLUDE_ITEM_SETS", [include]),
                                                            set_names(httpclient, "EXCLUDE_ITEM_SETS", [exclude])]
        result = http.infer("vaecf", inputs)
        assert ids[row].tolist() == result.as_numpy("TOP_ITEM_IDS")[0].tolist()
        np.testing.assert_array_equal(scores[row], result.as_numpy("TOP_SCORES")[0])
    # One list per history in predict; a bad name is that history's error, the others answer.
    got, _, _, errors = engine.predict(histories, include_sets=[["category=toys"], ["colour=red"]])
    toys = read_attributes(demo_attributes("multivae"))["category=toys"]
    assert set(got[0].tolist()) <= toys and len(got[0]) == 10 and errors[0] is None
    assert "colour=red" in errors[1]
    # A value no item has is an empty set: that history is answered with nothing, not an error.
    got, _, _, errors = engine.predict(histories, include_sets=[["category=toys"], ["category=nope"]])
    assert errors == [None, None] and len(got[1]) == 0
    with pytest.raises(ValueError, match="3 lists for 2 histories"):
        engine.recommend(histories, include_sets=[["category=toys"]] * 3)
    with pytest.raises(ValueError, match="not one string"):
        engine.recommend(histories, include_sets="category=toys")
    assert engine.item_sets["category=toys"] == len(toys)
