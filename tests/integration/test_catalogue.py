"""A live catalogue through the CLI: `recsys export-items --with-input-rows` writes a table that
`recsys predict --catalogue` takes back as a catalogue delta. Items cut out of each fixture
checkpoint (all four families; the checkpoint rewritten here with numpy, independently of recsys)
and given back as a delta answer as the engine converted from the whole checkpoint; retired items
are never returned while every other answer stays; a table that cannot apply is refused naming
the item. The engine-level equality at every precision and with the screen is tested in Rust
(engine/tests/catalogue.rs)."""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import FIXTURES, convert

KINDS = [("bert4rec", "bert4rec"), ("vaecf", "multivae"), ("sasrec", "sasrec"), ("gru4rec", "gru4rec")]
N_ITEMS = 2000
# Mult-VAE sums a history's input rows in index order, and a delta's new items come after every
# converted one: f32 rounding of that sum (the Rust test measures up to 6.1e-7).
VAECF_SCORE_REL_TOL = 1e-6


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    data = raw[8 + header_len:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", name
        start, end = info["data_offsets"]
        tensors[name] = np.frombuffer(data[start:end], dtype="<f4").reshape(info["shape"])
    return tensors


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        blob = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def cut_fixture(model_dir: str, cut: list[int], out: Path) -> tuple[Path, Path, Path]:
    """The fixture checkpoint without the items at internal indices `cut`: every axis over the
    items (N+1, or N+2 with BERT4Rec's mask token) loses them; the item map and config follow."""
    out.mkdir(parents=True)
    tensors = read_safetensors(FIXTURES / model_dir / "model.safetensors")
    for name, tensor in tensors.items():
        for axis, size in enumerate(tensor.shape):
            if size in (N_ITEMS + 1, N_ITEMS + 2):
                tensor = np.delete(tensor, cut, axis=axis)
        tensors[name] = tensor
    checkpoint = out / "model.safetensors"
    write_safetensors(checkpoint, tensors)
    lines = (FIXTURES / model_dir / "item_id_map.tsv").read_text().splitlines()[1:]
    kept = [line.split("\t")[1] for line in lines if int(line.split("\t")[0]) not in set(cut)]
    item_map = out / "item_id_map.tsv"
    item_map.write_text("internal_index\texternal_item_id\n" + "".join(f"{i + 1}\t{e}\n" for i, e in enumerate(kept)))
    config = json.loads((FIXTURES / model_dir / "config.json").read_text())
    n = N_ITEMS - len(cut)
    for key, value in [("n_real_items", n), ("recbole_n_items", n + 1), ("input_dim", n + 1),
                       ("mask_index", n + 1), ("item_embedding_rows", n + 2)]:
        if key in config:
            config[key] = value
    config_path = out / "config.json"
    config_path.write_text(json.dumps(config))
    return checkpoint, config_path, item_map


def predict(recsys_bin: Path, engine: Path, users: Path, *extra: str, k: int = 20) -> tuple[list[dict], str]:
    run = subprocess.run([str(recsys_bin), "predict", "--engine", str(engine), "--input", str(users), "--output", "-",
                          "--k", str(k), *extra], check=True, capture_output=True, text=True)
    return [json.loads(line) for line in run.stdout.splitlines()], run.stderr


def users_file(tmp_path: Path) -> Path:
    cases = [line.split("\t") for line in (FIXTURES / "test_set.tsv").read_text().splitlines()[1:201]]
    users = tmp_path / "users.jsonl"
    users.write_text("".join(json.dumps({"item_ids": [int(i) for i in case[2].split()]}) + "\n" for case in cases))
    return users


def export(recsys_bin: Path, engine: Path, out: Path) -> pa.Table:
    subprocess.run([str(recsys_bin), "export-items", "--engine", str(engine), "--output", str(out),
                    "--format", "parquet", "--with-input-rows"], check=True, capture_output=True)
    return pq.read_table(f"{out}.parquet")


def assert_same(kind: str, got: list[dict], want: list[dict]) -> None:
    for row, (g, w) in enumerate(zip(got, want)):
        if kind == "vaecf":
            np.testing.assert_allclose(g["scores"], w["scores"], rtol=VAECF_SCORE_REL_TOL, err_msg=f"row {row}")
            # Ranks may differ only between items whose scores agree to that tolerance.
            for rank, (gi, wi) in enumerate(zip(g["item_ids"], w["item_ids"])):
                if gi != wi:
                    assert abs(g["scores"][rank] - w["scores"][w["item_ids"].index(gi)]) <= \
                        VAECF_SCORE_REL_TOL * abs(w["scores"][rank]), (kind, row, rank)
        else:
            assert g == w, (kind, row)


def test_items_cut_from_the_checkpoint_and_given_back_answer_as_the_whole_engine(recsys_bin, tmp_path):
    users = users_file(tmp_path)
    cut = list(range(1, N_ITEMS + 1, 41)) + [N_ITEMS]
    for kind, model_dir in KINDS:
        full = tmp_path / f"{kind}-full"
        convert(recsys_bin, kind, model_dir, "model.safetensors", full, FIXTURES / model_dir / "item_id_map.tsv")
        table = export(recsys_bin, full, tmp_path / f"{kind}-items")
        assert table.schema.field("input_vector").type.list_size == (
            600 if kind == "vaecf" else table.schema.field("vector").type.list_size - 1)
        if kind != "vaecf":
            # Tied models: the input row is the vector's embedding.
            vectors = np.stack(table["vector"].to_numpy(zero_copy_only=False))
            inputs = np.stack(table["input_vector"].to_numpy(zero_copy_only=False))
            np.testing.assert_array_equal(vectors[:, :-1], inputs)
        # The cut items' rows as the whole engine exported them: the delta.
        delta = table.take([i - 1 for i in cut])
        pq.write_table(delta, tmp_path / f"{kind}-delta.parquet")

        checkpoint, config, item_map = cut_fixture(model_dir, cut, tmp_path / f"{kind}-cut-checkpoint")
        engine = tmp_path / f"{kind}-cut"
        subprocess.run([str(recsys_bin), "convert", "--force", "--kind", kind, "--checkpoint", str(checkpoint),
                        "--config", str(config), "--item-map", str(item_map), "--out", str(engine)],
                       check=True, capture_output=True)
        want, _ = predict(recsys_bin, full, users)
        alone, _ = predict(recsys_bin, engine, users)
        assert alone != want, kind
        got, note = predict(recsys_bin, engine, users, "--catalogue", str(tmp_path / f"{kind}-delta.parquet"))
        assert f"{len(cut)} item(s) added, 0 replaced, 0 retired ({N_ITEMS} items in all)" in note, note
        assert_same(kind, got, want)


def test_retired_items_leave_every_answer_and_others_stay(recsys_bin, tmp_path):
    users = users_file(tmp_path)
    for kind, model_dir in KINDS:
        engine = tmp_path / kind
        convert(recsys_bin, kind, model_dir, "model.safetensors", engine, FIXTURES / model_dir / "item_id_map.tsv")
        before, _ = predict(recsys_bin, engine, users, k=40)
        counts: dict[int, int] = {}
        for answer in before:
            for item in answer["item_ids"][:5]:
                counts[item] = counts.get(item, 0) + 1
        retired = sorted(counts, key=lambda i: (-counts[i], i))[:5]
        # A bare retirement: ids and op, vectors null (pyarrow writes variable-size lists).
        table = pa.table({"item_id": pa.array(retired, pa.int64()),
                          "vector": pa.array([None] * len(retired), pa.list_(pa.float32())),
                          "op": ["retire"] * len(retired)})
        pq.write_table(table, tmp_path / f"{kind}-retire.parquet")
        after, note = predict(recsys_bin, engine, users, "--catalogue", str(tmp_path / f"{kind}-retire.parquet"))
        assert "0 item(s) added, 0 replaced, 5 retired" in note, note
        for row, (got, all_) in enumerate(zip(after, before)):
            assert not set(got["item_ids"]) & set(retired), (kind, row)
            keep = [(i, s) for i, s in zip(all_["item_ids"], all_["scores"]) if i not in retired][:20]
            assert list(zip(got["item_ids"], got["scores"])) == keep, (kind, row)


def test_fold_in_writes_a_table_that_predict_and_publish_take(recsys_bin, tmp_path):
    """`recsys catalogue fold-in` on a cut SASRec engine: one row per cut item seen in the log,
    in the catalogue table schema (what `catalogue publish` reads); `predict --catalogue` then
    returns folded items; a log without a user column is refused naming it."""
    cut = list(range(25, N_ITEMS + 1, 25))
    checkpoint, config, item_map = cut_fixture("sasrec", cut, tmp_path / "cut-checkpoint")
    engine = tmp_path / "cut"
    subprocess.run([str(recsys_bin), "convert", "--force", "--kind", "sasrec", "--checkpoint", str(checkpoint),
                    "--config", str(config), "--item-map", str(item_map), "--out", str(engine)],
                   check=True, capture_output=True)
    rows = [line.split("\t") for line in (FIXTURES / "test_set.tsv").read_text().splitlines()[1:]]
    log = tmp_path / "train.inter"
    log.write_text("user_id:token\titem_id:token\ttimestamp:float\n" + "".join(
        f"{r[0]}\t{item}\t{1_600_000_000 + 60 * t}\n" for r in rows for t, item in enumerate(r[2].split()[:-1])))
    table = tmp_path / "folded.parquet"
    run = subprocess.run([str(recsys_bin), "catalogue", "fold-in", "--engine", str(engine), "--interactions",
                          str(log), "--output", str(table), "--negative-samples", "500", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["items"] == len(cut) and report["skipped"] == [] and report["input_rows"] == "tied", report
    folded = pq.read_table(table)
    assert folded.column_names == ["item_id", "vector", "op"]
    mapped = dict(line.split("\t") for line in (FIXTURES / "sasrec" / "item_id_map.tsv").read_text().splitlines()[1:])
    cut_ids = {int(mapped[str(i)]) for i in cut}
    assert set(folded["item_id"].to_pylist()) == cut_ids
    assert set(folded["op"].to_pylist()) == {"upsert"}
    answers, _ = predict(recsys_bin, engine, users_file(tmp_path), "--catalogue", str(table), k=20)
    assert any(i in cut_ids for a in answers for i in a["item_ids"]), "folded items are recommended"
    # A missing column is refused naming it.
    bad = tmp_path / "bad.inter"
    bad.write_text("who\titem_id\n1\t2\n")
    run = subprocess.run([str(recsys_bin), "catalogue", "fold-in", "--engine", str(engine), "--interactions",
                          str(bad), "--output", str(tmp_path / "x.parquet")], capture_output=True, text=True)
    assert run.returncode != 0 and "no user column" in run.stderr, run.stderr


def test_a_table_that_cannot_apply_is_refused_naming_the_item(recsys_bin, tmp_path):
    users = users_file(tmp_path)
    engine = tmp_path / "sasrec"
    convert(recsys_bin, "sasrec", "sasrec", "model.safetensors", engine, FIXTURES / "sasrec" / "item_id_map.tsv")
    first_id = int((FIXTURES / "sasrec" / "item_id_map.tsv").read_text().splitlines()[1].split("\t")[1])
    cases = [
        ({"item_id": [first_id], "vector": [[0.5] * 3]}, f"item {first_id}: vector holds 3 values"),
        ({"item_id": [123456789], "vector": [None], "op": ["retire"]}, "item 123456789 is not in the engine"),
        ({"item_id": [first_id], "vector": [[0.0] * 65], "op": ["delete"]}, 'op "delete" is neither'),
        ({"id": [1]}, 'no "item_id" column'),
    ]
    for columns, expected in cases:
        path = tmp_path / "bad.parquet"
        pq.write_table(pa.table(columns), path)
        run = subprocess.run([str(recsys_bin), "predict", "--engine", str(engine), "--input", str(users),
                              "--output", "-", "--catalogue", str(path)], capture_output=True, text=True)
        assert run.returncode != 0 and expected in run.stderr, (expected, run.stderr)


# ---------------------------------------------------------------------------------------------
# Through real tritonservers: deltas published by the CLI, polled and swapped in between batches.

import contextlib  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import tritonclient.http as httpclient  # noqa: E402

from conftest import contract_config  # noqa: E402
from s3_harness import CREDENTIALS, S3Server  # noqa: E402
from test_availability import metric, wait_for, write_atomically  # noqa: E402
from test_serving import make_inputs  # noqa: E402
from triton_harness import TritonServer  # noqa: E402

OBJECT = "recsys-catalogue.bin"
# Variable-size lists, as pandas and pyarrow write them from Python lists.
DELTA_SCHEMA = pa.schema([("item_id", pa.int64()), ("vector", pa.list_(pa.float32())),
                          ("input_vector", pa.list_(pa.float32())), ("op", pa.string())])


def histories(count: int) -> list[list[int]]:
    cases = [line.split("\t") for line in (FIXTURES / "test_set.tsv").read_text().splitlines()[1:]]
    return [[int(i) for i in case[2].split()][-20:] for case in cases[:count]]


def catalogue_publish(recsys_bin: Path, repository: str, model: str, table: Path) -> int:
    run = subprocess.run([str(recsys_bin), "catalogue", "publish", "--repository", repository, "--model", model,
                          "--json", str(table)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    return json.loads(run.stdout)["version"]


def expected_answers(recsys_bin: Path, engine: Path, source: Path, users: list[list[int]], tmp: Path) -> list[list[int]]:
    """`recsys predict --catalogue` over the object a version was published as: what a server
    holding that version answers."""
    lines = tmp / "expected-in.jsonl"
    lines.write_text("".join(json.dumps({"item_ids": h}) + "\n" for h in users))
    answers, _ = predict(recsys_bin, engine, lines, "--catalogue", str(source), k=10)
    return [a["item_ids"] for a in answers]


def served(client, model: str, history: list[int]) -> tuple[int, list[int]]:
    result = client.infer(model, make_inputs(httpclient, history, k=10))
    return result.get_response()["parameters"]["catalogue_version"], result.as_numpy("TOP_ITEM_IDS")[0].tolist()


class Load:
    """Client threads asking for the top 10 of fixed histories, each answer checked against what
    the catalogue version it names answers (`expected[version][history]`). Answers are checked
    when `wrong` is read, after the load: a version's expected answers are computed after it is
    published, and the server may serve it before they are."""

    def __init__(self, server: TritonServer, model: str, users: list[list[int]],
                 expected: dict[int, list[list[int]]], threads: int = 2):
        self.server, self.model, self.users, self.expected = server, model, users, expected
        self.answers, self.failures = 0, []
        self.results: list[tuple[int, int, list[int]]] = []
        self.seen: set[int] = set()
        self.stop, self.lock = threading.Event(), threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(i,)) for i in range(threads)]

    def run(self, seed: int) -> None:
        client = httpclient.InferenceServerClient(self.server.http_url)
        rng = random.Random(seed)
        deadline = time.monotonic() + 600
        try:
            while not self.stop.is_set() and time.monotonic() < deadline and self.answers < 500_000:
                u = rng.randrange(len(self.users))
                try:
                    version, ids = served(client, self.model, self.users[u])
                except Exception as e:  # noqa: BLE001  (every failure counts)
                    with self.lock:
                        self.failures.append(repr(e))
                    continue
                with self.lock:
                    self.answers += 1
                    self.seen.add(version)
                    self.results.append((version, u, ids))
        finally:
            client.close()

    @property
    def wrong(self) -> list[str]:
        """Every answer that is not its catalogue version's, or names a version never published."""
        wrong = []
        with self.lock:
            for version, u, ids in self.results:
                want = self.expected.get(version)
                if want is None:
                    wrong.append(f"catalogue version {version} was never published")
                elif ids != want[u]:
                    wrong.append(f"version {version} history {u}: {ids} != {want[u]}")
        return wrong

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def shop_engines(recsys_bin: Path, tmp_path: Path) -> tuple[Path, Path, pa.Table, list[int]]:
    """The SASRec fixture cut by 49 items (the engine served), the whole one, the whole engine's
    exported rows, and the cut internal indices."""
    cut = list(range(1, N_ITEMS + 1, 41))
    full = tmp_path / "full"
    convert(recsys_bin, "sasrec", "sasrec", "model.safetensors", full, FIXTURES / "sasrec" / "item_id_map.tsv")
    table = export(recsys_bin, full, tmp_path / "full-items")
    checkpoint, config, item_map = cut_fixture("sasrec", cut, tmp_path / "cut-checkpoint")
    engine = tmp_path / "cut"
    subprocess.run([str(recsys_bin), "convert", "--force", "--kind", "sasrec", "--checkpoint", str(checkpoint),
                    "--config", str(config), "--item-map", str(item_map), "--out", str(engine)],
                   check=True, capture_output=True)
    return engine, full, table, cut


def test_deltas_swapped_under_load_lose_no_request_and_bad_objects_keep_the_last_good_one(
        tmp_path, recsys_bin, backend_dir):
    engine, full, table, cut = shop_engines(recsys_bin, tmp_path)
    repo = tmp_path / "repo"
    (repo / "shop").mkdir(parents=True)
    shutil.copytree(engine, repo / "shop" / "1")
    (repo / "shop" / "config.pbtxt").write_text(contract_config(
        "shop", params={"catalogue_source": OBJECT, "catalogue_poll_seconds": "0.2"}))
    # A model of the whole engine: its catalogue objects are for another engine.
    (repo / "other").mkdir()
    shutil.copytree(full, repo / "other" / "1")
    (repo / "other" / "config.pbtxt").write_text(contract_config("other"))

    users = histories(6)
    rng = random.Random(5)
    ids = table["item_id"].to_pylist()
    vectors, inputs = table["vector"].to_pylist(), table["input_vector"].to_pylist()
    cut_rows = [i - 1 for i in cut]
    kept_rows = [r for r in range(N_ITEMS) if r not in set(cut_rows)]
    expected: dict[int, list[list[int]]] = {}
    with TritonServer(repo, backend_dir, explicit=True, load_models=["shop", "other"],
                      log_path=tmp_path / "tritonserver.log") as server:
        client = httpclient.InferenceServerClient(server.http_url)
        # No object yet: the catalogue as converted, version 0 in every response.
        expected[0] = [served(client, "shop", h)[1] for h in users]
        assert all(served(client, "shop", h)[0] == 0 for h in users)
        refused = 0
        latest = 0
        with Load(server, "shop", users, expected) as load:
            wait_for(lambda: load.answers > 20, "answers under load", 30)
            for step in range(12):
                if step % 4 == 3:
                    # A bad object where the delta belongs: refused, the last good one kept.
                    good = (repo / "shop" / OBJECT).read_bytes()
                    bad = [good[: len(good) // 2], good[:-1],
                           good[:-40] + bytes(b ^ 0x20 for b in good[-40:])][step // 4]
                    write_atomically(repo / "shop" / OBJECT, bad)
                    refused += 1
                    wait_for(lambda: metric(server, "recsys_catalogue_refused_total", "shop") == refused,
                             f"refusal {refused}", 10)
                    assert served(client, "shop", users[0])[0] == latest
                    write_atomically(repo / "shop" / OBJECT, good)
                    continue
                # Some of the cut items added, some converted items retired, some replaced by
                # another item's rows: the whole state each time.
                added = rng.sample(cut_rows, rng.randrange(5, len(cut_rows)))
                retired = rng.sample(kept_rows, 3)
                replaced = rng.sample([r for r in kept_rows if r not in retired], 4)
                rows = [{"item_id": ids[r], "vector": vectors[r], "input_vector": inputs[r], "op": "upsert"}
                        for r in added]
                # Each replaced item takes the next one's rows.
                rows += [{"item_id": ids[r], "vector": vectors[s], "input_vector": inputs[s], "op": "upsert"}
                         for r, s in zip(replaced, replaced[1:] + replaced[:1])]
                rows += [{"item_id": ids[r], "vector": None, "input_vector": None, "op": "retire"} for r in retired]
                delta = pa.Table.from_pylist(rows, schema=DELTA_SCHEMA)
                path = tmp_path / f"delta-{step}.parquet"
                pq.write_table(delta, path)
                latest = catalogue_publish(recsys_bin, str(repo), "shop", path)
                copy = tmp_path / f"v{latest}.bin"
                copy.write_bytes((repo / "shop" / OBJECT).read_bytes())
                expected[latest] = expected_answers(recsys_bin, engine, copy, users, tmp_path)
                wait_for(lambda: served(client, "shop", users[0])[0] == latest, f"version {latest} served", 10)
            marks = load.answers
            wait_for(lambda: load.answers > marks + 20, "answers after the last swap", 30)

            # An object made for another engine (the whole one): refused, naming why.
            other_table = tmp_path / "other.parquet"
            pq.write_table(table.take(cut_rows[:3]), other_table)
            catalogue_publish(recsys_bin, str(repo), "other", other_table)
            good = (repo / "shop" / OBJECT).read_bytes()
            write_atomically(repo / "shop" / OBJECT, (repo / "other" / OBJECT).read_bytes())
            refused += 1
            wait_for(lambda: metric(server, "recsys_catalogue_refused_total", "shop") == refused, "foreign", 10)
            write_atomically(repo / "shop" / OBJECT, good)
        assert load.failures == [], load.failures[:5]
        assert load.wrong == [], load.wrong[:5]
        assert load.answers > 200, load.answers
        assert len(load.seen) >= 6, sorted(load.seen)
        assert metric(server, "recsys_catalogue_version", "shop") == latest
        assert metric(server, "recsys_catalogue_refused_total", "shop") == refused == 4
        assert metric(server, "recsys_catalogue_delta_items", "shop") > 0
        log = server.log()
        assert len(re.findall(r"catalogue update from \S+ refused, catalogue version \d+ stays in force", log)) \
            == refused, log
        assert "truncated" in log and "SHA-256" in log and "was published for the engine" in log
        # The model without a catalogue_source names no catalogue version.
        result = client.infer("other", make_inputs(httpclient, users[0], k=3))
        assert "catalogue_version" not in result.get_response().get("parameters", {})
        assert server.is_live()
        client.close()


def test_a_compacted_version_serves_the_same_catalogue_under_load_and_takes_new_deltas(
        tmp_path, recsys_bin, backend_dir):
    """The served engine with a delta, compacted into version 2 (`recsys catalogue compact`) and
    approved under load: every answer is the one its catalogue version gives, before, across and
    after the switch (version 2 takes the stored object as folded in, so it names the same
    catalogue version); a delta published afterwards applies to version 2."""
    engine, _full, table, cut = shop_engines(recsys_bin, tmp_path)
    repo = tmp_path / "repo"
    (repo / "shop").mkdir(parents=True)
    (repo / "shop" / "config.pbtxt").write_text(contract_config(
        "shop", params={"catalogue_source": OBJECT, "catalogue_poll_seconds": "0.2"}))

    def recsys(*args: str) -> str:
        run = subprocess.run([str(recsys_bin), *args, "--repository", str(repo), "--model", "shop"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"{args}: exit {run.returncode}\n{run.stdout}\n{run.stderr}"
        return run.stdout

    recsys("publish", "--approve", "--engine", str(engine))
    users = histories(6)
    ids, vectors, inputs = (table[c].to_pylist() for c in ("item_id", "vector", "input_vector"))
    cut_rows = [i - 1 for i in cut]
    kept_rows = [r for r in range(N_ITEMS) if r not in set(cut_rows)]
    retired = kept_rows[10:13]
    rows = [{"item_id": ids[r], "vector": vectors[r], "input_vector": inputs[r], "op": "upsert"} for r in cut_rows]
    rows += [{"item_id": ids[r], "vector": None, "input_vector": None, "op": "retire"} for r in retired]
    first = tmp_path / "first.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=DELTA_SCHEMA), first)
    expected: dict[int, list[list[int]]] = {}
    with TritonServer(repo, backend_dir, explicit=True, load_models=["shop"],
                      log_path=tmp_path / "tritonserver.log") as server:
        url = f"http://{server.http_url}"
        client = httpclient.InferenceServerClient(server.http_url)
        latest = catalogue_publish(recsys_bin, str(repo), "shop", first)
        copy = tmp_path / f"v{latest}.bin"
        copy.write_bytes((repo / "shop" / OBJECT).read_bytes())
        expected[latest] = expected_answers(recsys_bin, repo / "shop" / "1", copy, users, tmp_path)
        wait_for(lambda: served(client, "shop", users[0])[0] == latest, "the delta served", 10)

        def model_version() -> str:
            return client.infer("shop", make_inputs(httpclient, users[0], k=3)).get_response()["model_version"]

        with Load(server, "shop", users, expected) as load:
            wait_for(lambda: load.answers > 20, "answers under load", 30)
            compacted = json.loads(recsys("catalogue", "compact", "--json"))
            assert (compacted["version"], compacted["catalogue_version"], compacted["added"],
                    compacted["retired"]) == (2, latest, len(cut), len(retired)), compacted
            assert model_version() == "1", "a pending version must not serve"
            out = recsys("approve", "--version", "2", "--server", url, "--canary-on-traffic")
            assert "now serves shop version 2" in out, out
            wait_for(lambda: model_version() == "2", "version 2 served", 30)
            marks = load.answers
            wait_for(lambda: load.answers > marks + 50, "answers from version 2", 30)
            # A delta for version 2: two more items retired.
            more = rows + [{"item_id": ids[r], "vector": None, "input_vector": None, "op": "retire"}
                           for r in kept_rows[20:22]]
            second = tmp_path / "second.parquet"
            pq.write_table(pa.Table.from_pylist(more, schema=DELTA_SCHEMA), second)
            latest = catalogue_publish(recsys_bin, str(repo), "shop", second)
            copy = tmp_path / f"v{latest}.bin"
            copy.write_bytes((repo / "shop" / OBJECT).read_bytes())
            expected[latest] = expected_answers(recsys_bin, repo / "shop" / "2", copy, users, tmp_path)
            wait_for(lambda: served(client, "shop", users[0])[0] == latest, f"version {latest} served", 10)
            marks = load.answers
            wait_for(lambda: load.answers > marks + 20, "answers after the new delta", 30)
        assert load.failures == [], load.failures[:5]
        assert load.wrong == [], load.wrong[:5]
        assert load.seen == {1, 2}, load.seen
        log = server.log()
        assert "already folded into this engine by compaction" in log, log[-3000:]
        assert "refused" not in log, log[-3000:]
        client.close()


def test_two_replicas_on_one_s3_repository_take_a_delta_within_one_poll_interval(
        tmp_path, recsys_bin, backend_dir, monkeypatch):
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)  # recsys and tritonserver inherit them
    engine, full, table, cut = shop_engines(recsys_bin, tmp_path)
    poll = 2.0
    users = histories(3)
    with S3Server(tmp_path / "moto.log") as s3:
        s3.client().create_bucket(Bucket="models")
        uri = s3.uri("models", "shop-repo")
        config = contract_config("shop", params={"catalogue_source": f"{uri}/shop/{OBJECT}",
                                                 "catalogue_poll_seconds": str(poll)})
        client = s3.client()
        client.put_object(Bucket="models", Key="shop-repo/shop/config.pbtxt", Body=config.encode())
        for f in engine.iterdir():
            client.put_object(Bucket="models", Key=f"shop-repo/shop/1/{f.name}", Body=f.read_bytes())
        with contextlib.ExitStack() as stack:
            servers = [stack.enter_context(TritonServer(uri, backend_dir, explicit=True, load_models=["shop"],
                                                        log_path=tmp_path / f"replica{i}.log"))
                       for i in range(2)]
            clients = [httpclient.InferenceServerClient(s.http_url) for s in servers]
            assert [served(c, "shop", users[0])[0] for c in clients] == [0, 0]
            # Every cut item back: both replicas answer as the whole engine does.
            delta = tmp_path / "all.parquet"
            pq.write_table(table.take([i - 1 for i in cut]), delta)
            version = catalogue_publish(recsys_bin, uri, "shop", delta)
            published = time.monotonic()
            for c in clients:
                wait_for(lambda: served(c, "shop", users[0])[0] == version, "a replica on the delta", poll + 3)
            took = time.monotonic() - published
            assert took <= poll + 3, took
            lines = tmp_path / "users.jsonl"
            lines.write_text("".join(json.dumps({"item_ids": h}) + "\n" for h in users))
            whole, _ = predict(recsys_bin, full, lines, k=10)
            for c in clients:
                assert [served(c, "shop", h)[1] for h in users] == [a["item_ids"] for a in whole]
            show = subprocess.run([str(recsys_bin), "catalogue", "show", "--repository", uri, "--model", "shop",
                                   "--json"], capture_output=True, text=True, timeout=120)
            assert show.returncode == 0, show.stderr
            shown = json.loads(show.stdout)
            assert shown["version"] == version and shown["rows"] == len(cut)
            for s in servers:
                assert metric(s, "recsys_catalogue_version", "shop") == version
            for c in clients:
                c.close()


def test_the_python_package_loads_a_published_delta_and_answers_as_predict(tmp_path, recsys_bin):
    import recsys  # noqa: PLC0415  (the wheel, installed by the test command)

    engine, full, table, cut = shop_engines(recsys_bin, tmp_path)
    repo = tmp_path / "repo"
    (repo / "shop").mkdir(parents=True)
    shutil.copytree(engine, repo / "shop" / "1")
    (repo / "shop" / "config.pbtxt").write_text(contract_config("shop", params={"catalogue_source": OBJECT}))
    delta = tmp_path / "delta.parquet"
    pq.write_table(table.take([i - 1 for i in cut]), delta)
    assert catalogue_publish(recsys_bin, str(repo), "shop", delta) == 1
    users = histories(20)
    lines = tmp_path / "users.jsonl"
    lines.write_text("".join(json.dumps({"item_ids": h}) + "\n" for h in users))
    whole, _ = predict(recsys_bin, full, lines, k=10)

    py = recsys.Engine(str(engine), threads=1)
    assert py.catalogue_version is None and py.num_items == N_ITEMS - len(cut)
    assert py.load_catalogue(str(repo / "shop" / OBJECT)) == 1
    assert py.catalogue_version == 1 and py.num_items == N_ITEMS
    ids, _ = py.recommend(users, k=10)
    assert ids.tolist() == [a["item_ids"] for a in whole]
    # An object for another engine is refused and the catalogue in force stays.
    other = recsys.Engine(str(full), threads=1)
    with pytest.raises(recsys.RecsysError, match="was published for the engine"):
        other.load_catalogue(str(repo / "shop" / OBJECT))
    assert other.catalogue_version is None
