"""`recsys export-items` read by numpy, as an ANN library would read it: a float32 [N, d + 1] array in
item order, and the external ids one per line. That the rows give the model's scores by inner product
is checked in Rust (cli/tests/cli_export.rs) against the engine's own scores."""

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


def test_pyarrow_reads_the_parquet_table_as_the_npy_one(recsys_bin, tmp_path):
    """--format both: the Parquet file (read by pyarrow, as Milvus, DuckDB or pandas would) holds the
    same rows and ids as the .npy pair, with the catalogue's id type; --format parquet writes it alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = (FIXTURES / "bert4rec" / "item_id_map.tsv").read_text().splitlines()[1:]
    string_map = tmp_path / "string_map.tsv"
    string_map.write_text("".join(f"{i}\tsku-{e}\n" for i, e in (l.split("\t") for l in lines)))
    for kind, model_dir, item_map, id_type in [
        ("vaecf", "multivae", None, pa.int64()),
        ("bert4rec", "bert4rec", string_map, pa.string()),
    ]:
        engine = tmp_path / f"{kind}-engine"
        convert(recsys_bin, kind, model_dir, "model.safetensors", engine, item_map)
        out = tmp_path / kind
        summary = json.loads(subprocess.run(
            [str(recsys_bin), "export-items", "--engine", str(engine), "--output", str(out), "--format", "both",
             "--json"], check=True, capture_output=True, text=True).stdout)
        assert summary["parquet"] == f"{out}.parquet" and summary["table"] == f"{out}.npy"
        table = pq.read_table(f"{out}.parquet")
        columns = summary["columns"]
        assert table.schema.field("item_id").type == id_type
        assert table.schema.field("vector").type == pa.list_(pa.field("item", pa.float32(), nullable=False), columns)
        assert b"recsys.vector" in table.schema.metadata
        vectors = np.stack(table["vector"].to_numpy(zero_copy_only=False))
        np.testing.assert_array_equal(vectors, np.load(f"{out}.npy"))
        ids = [str(i) for i in table["item_id"].to_pylist()]
        assert ids == (tmp_path / f"{kind}.ids.txt").read_text().split("\n")[:-1]
        # Parquet alone: only FILE.parquet is written, and an existing one needs --force.
        alone = tmp_path / f"{kind}-alone.parquet"
        subprocess.run([str(recsys_bin), "export-items", "--engine", str(engine), "--output", str(alone),
                        "--format", "parquet"], check=True, capture_output=True)
        assert alone.exists() and not (tmp_path / f"{kind}-alone.npy").exists()
        assert pq.read_table(alone).equals(table)
        again = subprocess.run([str(recsys_bin), "export-items", "--engine", str(engine), "--output", str(alone),
                                "--format", "parquet"], capture_output=True, text=True)
        assert again.returncode == 2 and "already exists; pass --force" in again.stderr
