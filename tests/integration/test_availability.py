"""Live availability through real tritonservers: the availability object `recsys availability
publish` writes is polled by the backend and swapped in between batches.

Under continuous load (two client threads filtering by the live sets), the source is replaced 50
times: new versions published by the CLI, and truncated, damaged and foreign files written in their
place, which must be refused (log line, metric) with the last good version kept. Every answer names
the availability version it used (response parameter), and is checked against that version's sets
as this test wrote them: no answer mixes two versions, none is lost. Then two replicas on one s3://
repository (a real S3-compatible server) converge on a newly published version within one poll
interval, and a model that reads its source only at load takes a new one on an explicit load
request."""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import FIXTURES, contract_config
from s3_harness import CREDENTIALS, S3Server
from test_filters import reference, set_names
from test_serving import make_inputs
from triton_harness import TritonServer

OBJECT = "recsys-availability.bin"
HISTORY = [10011403, 10011207, 10011739]


def catalogue() -> list[int]:
    lines = (FIXTURES / "sasrec" / "item_id_map.tsv").read_text().splitlines()[1:]
    return [int(line.split("\t")[1]) for line in lines]


def stock_table(path: Path, rng: random.Random, items: list[int], in_stock: float) -> dict[str, set[int]]:
    """A stock feed: each item in or out (about `in_stock` in), and the warehouses holding it; plus
    ids the catalogue does not know. Returns its sets as this test reads them."""
    sets: dict[str, set[int]] = {}
    lines = ["item_id\tstock\twarehouse"]
    for item in items:
        stock = "in" if rng.random() < in_stock else "out"
        warehouses = [w for w in ("north", "south") if rng.random() < 0.5]
        lines.append(f"{item}\t{stock}\t{'|'.join(warehouses)}")
        sets.setdefault(f"stock={stock}", set()).add(item)
        for w in warehouses:
            sets.setdefault(f"warehouse={w}", set()).add(item)
    lines += [f"{99_000_000 + i}\tin\tnorth" for i in range(5)]
    path.write_text("\n".join(lines) + "\n")
    return sets


def publish(recsys_bin: Path, repository: str, model: str, table: Path, version: int) -> None:
    run = subprocess.run([str(recsys_bin), "availability", "publish", "--repository", repository, "--model", model,
                          "--version", str(version), str(table)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert f"version {version}" in run.stdout, run.stdout


def write_atomically(path: Path, data: bytes) -> None:
    """A whole file at once (as a store's put is), so the server reads it or the one before."""
    scratch = path.with_suffix(".partial")
    scratch.write_bytes(data)
    scratch.replace(path)


def served_version(client, model: str) -> int:
    result = client.infer(model, make_inputs(httpclient, HISTORY, k=1))
    return result.get_response()["parameters"]["availability_version"]


def wait_for(condition, what: str, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() < start + timeout:
        if condition():
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def metric(server: TritonServer, name: str, model: str) -> float | None:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


class FilteredLoad:
    """Client threads asking for in-stock items of one warehouse, leaving out-of-stock ones out,
    each answer checked against the sets of the version it names."""

    def __init__(self, server: TritonServer, model: str, versions: dict[int, dict[str, set[int]]], threads: int = 2):
        self.server, self.model, self.versions = server, model, versions
        self.answers = 0
        self.seen_versions: set[int] = set()
        self.failures: list[str] = []
        self.wrong: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(i,)) for i in range(threads)]

    def run(self, seed: int) -> None:
        client = httpclient.InferenceServerClient(self.server.http_url)
        rng = random.Random(seed)
        deadline = time.monotonic() + 600
        try:
            while not self.stop.is_set() and time.monotonic() < deadline and self.answers < 500_000:
                warehouse = rng.choice(["north", "south"])
                inputs = make_inputs(httpclient, HISTORY, k=10) + [
                    set_names(httpclient, "INCLUDE_ITEM_SETS", [[f"warehouse={warehouse}"]]),
                    set_names(httpclient, "EXCLUDE_ITEM_SETS", [["stock=out"]]),
                ]
                try:
                    result = client.infer(self.model, inputs)
                except Exception as e:  # noqa: BLE001  (every failure counts)
                    with self.lock:
                        self.failures.append(repr(e))
                    continue
                version = result.get_response()["parameters"]["availability_version"]
                ids = set(result.as_numpy("TOP_ITEM_IDS")[0].tolist())
                sets = self.versions.get(version)
                with self.lock:
                    self.answers += 1
                    self.seen_versions.add(version)
                    if sets is None:
                        self.wrong.append(f"version {version} was never published")
                    elif ids & sets.get("stock=out", set()) or not ids <= sets.get(f"warehouse={warehouse}", set()):
                        self.wrong.append(f"version {version}: {sorted(ids)} breaks its sets ({warehouse})")
        finally:
            client.close()

    def __enter__(self) -> "FilteredLoad":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def bad_object(kind: int, good: bytes) -> bytes:
    """A file a feed job may leave at the source: cut short (in the header, in the payload), one
    byte altered, or a table written where the object belongs."""
    return [
        good[: len(good) // 2],
        good[:12],
        good[:-1],
        good[:-40] + bytes(b ^ 0x20 for b in good[-40:]),
        b"item_id\tstock\n10011403\tin\n",
    ][kind % 5]


def test_fifty_replacements_under_load_lose_no_request_and_keep_the_last_good_version(
        tmp_path, recsys_bin, backend_dir, repository):
    repo = tmp_path / "repo"
    model_dir = repo / "shop"
    (model_dir).mkdir(parents=True)
    shutil.copytree(repository.parent / "engines" / "sasrec", model_dir / "1")
    (model_dir / "config.pbtxt").write_text(contract_config(
        "shop", params={"availability_source": OBJECT, "availability_poll_seconds": "0.2"}))
    # Read at load only: a new object is taken in when the model is loaded again (the object sits
    # in the model's folder, so the load request finds the model changed).
    at_load = repo / "shop_at_load"
    at_load.mkdir()
    shutil.copytree(repository.parent / "engines" / "sasrec", at_load / "1")
    (at_load / "config.pbtxt").write_text(contract_config(
        "shop_at_load", params={"availability_source": OBJECT, "availability_poll_seconds": "0"}))

    rng = random.Random(43)
    items = catalogue()
    versions: dict[int, dict[str, set[int]]] = {}
    versions[1] = stock_table(tmp_path / "v1.tsv", rng, items, 0.5)
    publish(recsys_bin, str(repo), "shop", tmp_path / "v1.tsv", 1)
    publish(recsys_bin, str(repo), "shop_at_load", tmp_path / "v1.tsv", 1)

    with TritonServer(repo, backend_dir, explicit=True, load_models=["shop", "shop_at_load"],
                      log_path=tmp_path / "tritonserver.log") as server:
        client = httpclient.InferenceServerClient(server.http_url)
        assert served_version(client, "shop") == 1
        assert served_version(client, "shop_at_load") == 1
        refused = 0
        latest = 1
        with FilteredLoad(server, "shop", versions) as load:
            wait_for(lambda: load.answers > 20, "answers under load", 30)
            for step in range(50):
                if step % 3 == 2:
                    # A bad file where the object belongs: refused, the last good one kept.
                    good = (model_dir / OBJECT).read_bytes()
                    write_atomically(model_dir / OBJECT, bad_object(step // 3, good))
                    refused += 1
                    wait_for(lambda: metric(server, "recsys_availability_refused_total", "shop") == refused,
                             f"refusal {refused}", 10)
                    assert served_version(client, "shop") == latest
                else:
                    latest += 1 if step % 4 else 2  # versions need only grow
                    versions[latest] = stock_table(tmp_path / f"v{latest}.tsv", rng, items, rng.choice([0.05, 0.3, 0.7]))
                    publish(recsys_bin, str(repo), "shop", tmp_path / f"v{latest}.tsv", latest)
                    wait_for(lambda: served_version(client, "shop") == latest, f"version {latest} served", 10)
            marks = load.answers
            wait_for(lambda: load.answers > marks + 20, "answers after the last replacement", 30)
        assert load.failures == [], load.failures[:5]
        assert load.wrong == [], load.wrong[:5]
        assert load.answers > 200, load.answers
        assert len(load.seen_versions) > 10, sorted(load.seen_versions)
        assert metric(server, "recsys_availability_refused_total", "shop") == refused == 16
        assert metric(server, "recsys_availability_version", "shop") == latest
        age = metric(server, "recsys_availability_age_seconds", "shop")
        assert age is not None and 0 <= age < 120, age
        log = server.log()
        assert len(re.findall(r"availability update from \S+ refused, version \d+ stays in force", log)) == refused, log
        assert "truncated" in log and "SHA-256" in log and "bad magic" in log

        # A value no item has in the live object is an empty set: including it answers nothing,
        # excluding it drops nothing. A column that exists nowhere is refused, naming the columns
        # there are (the live ones included).
        empty = make_inputs(httpclient, HISTORY, k=5) + [set_names(httpclient, "INCLUDE_ITEM_SETS", [["stock=maybe"]])]
        assert (client.infer("shop", empty).as_numpy("TOP_ITEM_IDS")[0] == -1).all()
        unfiltered = client.infer("shop", make_inputs(httpclient, HISTORY, k=5)).as_numpy("TOP_ITEM_IDS")[0]
        nothing_dropped = make_inputs(httpclient, HISTORY, k=5) + [set_names(httpclient, "EXCLUDE_ITEM_SETS", [["stock=maybe"]])]
        assert client.infer("shop", nothing_dropped).as_numpy("TOP_ITEM_IDS")[0].tolist() == unfiltered.tolist()
        bad = make_inputs(httpclient, HISTORY, k=5) + [set_names(httpclient, "INCLUDE_ITEM_SETS", [["colour=red"]])]
        with pytest.raises(Exception, match=r'no attribute column "colour" \(columns: [^)]*stock'):
            client.infer("shop", bad)

        # Offline as online: the Python package and predict take the same object and answer as
        # the server does, which is numpy's top-k over the full score vector under its sets.
        import recsys  # noqa: PLC0415  (the wheel, installed by the test command)

        engine = recsys.Engine(str(model_dir / "1"), threads=1)
        assert engine.availability_version is None
        assert engine.load_availability(str(model_dir / OBJECT)) == latest
        assert engine.availability_version == latest
        sets = versions[latest]
        assert engine.item_sets["stock=in"] == len(sets["stock=in"])
        with pytest.raises(recsys.RecsysError, match="bad magic"):
            engine.load_availability(str(tmp_path / "v1.tsv"))  # not an object at all
        include, exclude = ["warehouse=north"], ["stock=out"]
        ids, scores = engine.recommend([HISTORY], k=10, include_sets=include, exclude_sets=exclude)
        inputs = make_inputs(httpclient, HISTORY, k=10) + [set_names(httpclient, "INCLUDE_ITEM_SETS", [include]),
                                                           set_names(httpclient, "EXCLUDE_ITEM_SETS", [exclude])]
        served = client.infer("shop", inputs)
        assert ids[0].tolist() == served.as_numpy("TOP_ITEM_IDS")[0].tolist()
        np.testing.assert_array_equal(scores[0], served.as_numpy("TOP_SCORES")[0])
        want, _ = reference(engine.score([HISTORY])[0], np.asarray(engine.item_ids), sets, include, exclude,
                            set(HISTORY), None, 10)
        assert ids[0].tolist() == want
        lines = tmp_path / "in.jsonl"
        lines.write_text(json.dumps({"item_ids": HISTORY, "k": 10, "include_item_sets": include,
                                     "exclude_item_sets": exclude}) + "\n")
        run = subprocess.run([str(recsys_bin), "predict", "--engine", str(model_dir / "1"), "--input", str(lines),
                              "--output", "-", "--availability", str(model_dir / OBJECT)],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["item_ids"] == want
        assert f"availability version {latest}" in run.stderr

        # The model that reads at load only answers from version 1 until it is loaded again.
        publish(recsys_bin, str(repo), "shop_at_load", tmp_path / f"v{latest}.tsv", 2)
        time.sleep(0.5)
        assert served_version(client, "shop_at_load") == 1
        client.load_model("shop_at_load")
        assert served_version(client, "shop_at_load") == 2
        assert server.is_live()
        client.close()


def test_two_replicas_on_one_s3_repository_converge_within_one_poll_interval(
        tmp_path, recsys_bin, backend_dir, repository, monkeypatch):
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)  # recsys and tritonserver inherit them
    poll = 2.0
    with S3Server(tmp_path / "moto.log") as s3:
        s3.client().create_bucket(Bucket="models")
        uri = s3.uri("models", "shop-repo")
        source = f"{uri}/shop/{OBJECT}"
        config = contract_config("shop", params={"availability_source": source,
                                                 "availability_poll_seconds": str(poll)})
        client = s3.client()
        client.put_object(Bucket="models", Key="shop-repo/shop/config.pbtxt", Body=config.encode())
        engine = repository.parent / "engines" / "sasrec"
        for f in engine.iterdir():
            client.put_object(Bucket="models", Key=f"shop-repo/shop/1/{f.name}", Body=f.read_bytes())
        rng = random.Random(7)
        items = catalogue()
        stock_table(tmp_path / "v1.tsv", rng, items, 0.5)
        publish(recsys_bin, uri, "shop", tmp_path / "v1.tsv", 1)

        with contextlib.ExitStack() as stack:
            servers = [stack.enter_context(TritonServer(uri, backend_dir, explicit=True, load_models=["shop"],
                                                        log_path=tmp_path / f"replica{i}.log"))
                       for i in range(2)]
            clients = [httpclient.InferenceServerClient(s.http_url) for s in servers]
            assert [served_version(c, "shop") for c in clients] == [1, 1]
            for version in (2, 3):
                sets = stock_table(tmp_path / f"v{version}.tsv", rng, items, 0.3)
                publish(recsys_bin, uri, "shop", tmp_path / f"v{version}.tsv", version)
                published = time.monotonic()
                for c in clients:
                    wait_for(lambda: served_version(c, "shop") == version, f"a replica on version {version}",
                             poll + 1.5)
                took = time.monotonic() - published
                assert took <= poll + 1.5, took
                # Both answer from the same sets now.
                inputs = make_inputs(httpclient, HISTORY, k=10) + [
                    set_names(httpclient, "INCLUDE_ITEM_SETS", [["stock=in"]])]
                answers = [c.infer("shop", inputs).as_numpy("TOP_ITEM_IDS")[0].tolist() for c in clients]
                assert answers[0] == answers[1] and set(answers[0]) <= sets["stock=in"]
            for s in servers:
                assert metric(s, "recsys_availability_version", "shop") == 3
            for c in clients:
                c.close()
