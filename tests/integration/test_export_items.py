"""`recsys export-items` read by numpy, as an ANN library would read it: a float32 [N, d + 1] array in
item order, and the external ids one per line. That the rows give the model's scores by inner product
is checked in Rust (converter/tests/cli.rs) against the engine's own scores."""

from __future__ import annotations

import json
import subprocess

import numpy as np

from conftest import FIXTURES, convert


def test_numpy_loads_the_item_table_and_its_ids(recsys_bin, tmp_path):
    engine = tmp_path / "vaecf"
    convert(recsys_bin, "vaecf", "multivae", "model.safetensors", engine)
    out = tmp_path / "items"
    subprocess.run([str(recsys_bin), "export-items", "--engine", str(engine), "--output", str(out)],
                   check=True, capture_output=True)
    table = np.load(tmp_path / "items.npy")
    ids = (tmp_path / "items.ids.txt").read_text().split("\n")[:-1]
    catalogue = [line.split("\t")[1] for line in (FIXTURES / "multivae" / "item_id_map.tsv").read_text().splitlines()[1:]]
    assert table.dtype == np.float32 and table.flags["C_CONTIGUOUS"]
    assert table.shape[0] == len(catalogue) == len(ids)
    assert table.shape[1] > 1 and np.isfinite(table).all()
    # Row r is the item with internal index r + 1, whose external id the item map gives.
    internal_to_external = {int(line.split("\t")[0]): line.split("\t")[1]
                            for line in (FIXTURES / "multivae" / "item_id_map.tsv").read_text().splitlines()[1:]}
    assert ids == [internal_to_external[r + 1] for r in range(len(ids))]


def test_faiss_over_the_exported_items_returns_the_engines_top100(recsys_bin, tmp_path):
    """Retrieval as a deployment does it: an exact inner-product index (FAISS IndexFlatIP) over the
    exported rows, queried with the user embeddings `recsys predict --return-embedding` answers, with
    the history left out afterwards, returns what the engine recommends."""
    import faiss

    # FAISS sums the inner products in another order than the engine: scores agree to this, and
    # only items this close to the 100th may change places at the edge.
    score_abs_tol = 1e-4
    cases = [line.split("\t") for line in (FIXTURES / "test_set.tsv").read_text().splitlines()[1:201]]
    for kind, model_dir in [("bert4rec", "bert4rec"), ("vaecf", "multivae")]:
        engine = tmp_path / kind
        convert(recsys_bin, kind, model_dir, "model.safetensors", engine)
        subprocess.run([str(recsys_bin), "export-items", "--engine", str(engine), "--output", str(tmp_path / kind)],
                       check=True, capture_output=True)
        table = np.load(tmp_path / f"{kind}.npy")
        ids = (tmp_path / f"{kind}.ids.txt").read_text().split("\n")[:-1]
        users = tmp_path / f"{kind}-users.jsonl"
        users.write_text("".join(json.dumps({"item_ids": case[2].split()}) + "\n" for case in cases))
        answers = subprocess.run(
            [str(recsys_bin), "predict", "--engine", str(engine), "--input", str(users), "--output", "-",
             "--k", "100", "--return-embedding"],
            check=True, capture_output=True, text=True).stdout.splitlines()
        answers = [json.loads(line) for line in answers]
        index = faiss.IndexFlatIP(table.shape[1])
        index.add(table)
        queries = np.array([a["embedding"] for a in answers], dtype=np.float32)
        longest = max(len(case[2].split()) for case in cases)
        scores, rows = index.search(queries, 100 + longest)
        same = 0
        for case, answer, user_scores, user_rows in zip(cases, answers, scores, rows):
            seen = set(case[2].split())
            hits = [(ids[r], s) for r, s in zip(user_rows, user_scores) if ids[r] not in seen][:100]
            want = [str(i) for i in answer["item_ids"]]
            assert len(hits) == len(want) == 100
            for (got_id, got_score), want_id, want_score in zip(hits, want, answer["scores"]):
                assert abs(got_score - want_score) <= score_abs_tol, (kind, got_id, want_id)
                same += got_id == want_id
        assert same >= 0.999 * 100 * len(cases), (kind, same)
