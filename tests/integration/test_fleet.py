"""A fleet on object storage: two tritonservers (explicit model control) load the same s3://
repository from a real S3-compatible server on 127.0.0.1. Under continuous load on both replicas:
publish v2 (pending: v1 keeps serving), approve it (both replicas serve v2), reject it (both back on
v1), with zero failed requests. Then one replica down during an approve: a per-replica report, the
reachable replica on the new version, exit status 4."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import convert
from s3_harness import CREDENTIALS, S3Server
from triton_harness import TritonServer

PARTIAL_ROLLOUT_EXIT = 4


@pytest.fixture
def s3(tmp_path, monkeypatch):
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)  # recsys and tritonserver inherit them
    with S3Server(tmp_path / "moto.log") as server:
        server.client().create_bucket(Bucket="models")
        yield server


class Load:
    """One client thread per replica, each recording the model version of every answer."""

    def __init__(self, server: TritonServer):
        self.client = httpclient.InferenceServerClient(server.http_url)
        self.seen: list[str] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)

    def run(self):
        items = np.array([[10011403, 10011207, 10011739]], dtype=np.int64)
        deadline = time.monotonic() + 240
        try:
            while not self.stop.is_set() and time.monotonic() < deadline and len(self.seen) < 100_000:
                inp = httpclient.InferInput("ITEM_IDS", [1, 3], "INT64")
                inp.set_data_from_numpy(items)
                try:
                    self.seen.append(self.client.infer("bert4rec", [inp]).get_response()["model_version"])
                except Exception as e:  # noqa: BLE001  (every failure counts)
                    self.failures.append(repr(e))
        finally:
            # A kept-alive connection left open holds a stopping tritonserver in its graceful wait
            # ("Found 1 HTTP service connections") until the harness kills it.
            self.client.close()

    def versions_since(self, mark: int) -> set[str]:
        return set(self.seen[mark:])


def wait_for(condition, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_two_replicas_on_one_s3_repository_switch_together_without_failed_requests(
        tmp_path, recsys_bin, backend_dir, s3):
    uri = s3.uri("models", "fleet/repo")
    convert(recsys_bin, "bert4rec", "bert4rec", "model.pt", tmp_path / "fp32")
    # v2: the same model at int8, so its answers (and its version number) are distinguishable.
    convert(recsys_bin, "bert4rec", "bert4rec", "model.safetensors", tmp_path / "int8", extra=["--precision", "int8"])

    def recsys(*args, expect=0):
        run = subprocess.run([str(recsys_bin), *args, "--repository", uri, "--model", "bert4rec"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == expect, f"{args}: exit {run.returncode}\n{run.stdout}\n{run.stderr}"
        return run

    out = recsys("publish", "--approve", "--engine", str(tmp_path / "fp32")).stdout
    assert "wrote a minimal one" in out and "version 1 (approved" in out, out
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket="models", Prefix="fleet/repo/")["Contents"]}
    assert {"fleet/repo/bert4rec/config.pbtxt", "fleet/repo/bert4rec/1/recsys-version.json",
            "fleet/repo/bert4rec/1/weights.safetensors"} <= keys, keys

    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(TritonServer(uri, backend_dir, explicit=True, load_models=["bert4rec"],
                                                    log_path=tmp_path / f"replica{i}.log"))
                   for i in range(2)]
        urls = [f"http://{s.http_url}" for s in servers]
        server_flags = [flag for url in urls for flag in ("--server", url)]
        loads = [Load(s) for s in servers]
        for load in loads:
            load.thread.start()
        try:
            wait_for(lambda: all(len(load.seen) > 5 for load in loads), "both replicas answering")
            assert all(load.versions_since(0) == {"1"} for load in loads)

            out = recsys("publish", "--engine", str(tmp_path / "int8"), *server_flags).stdout
            assert "version 2 (pending" in out, out
            time.sleep(0.3)
            assert all(load.versions_since(0) == {"1"} for load in loads), "a pending version must not serve"

            approved = json.loads(recsys("approve", "--version", "2", *server_flags, "--json").stdout)
            assert approved["serving_version"] == 2
            assert approved["rollout"]["complete"] is True
            assert [r["server"] for r in approved["rollout"]["replicas"]] == urls
            assert all(r["outcome"] == "serving" for r in approved["rollout"]["replicas"])
            marks = [len(load.seen) for load in loads]
            wait_for(lambda: all(len(load.seen) > m + 20 for load, m in zip(loads, marks)), "answers after approve")
            assert all(load.versions_since(m) == {"2"} for load, m in zip(loads, marks)), \
                "every replica serves v2 once approve returns"

            out = recsys("reject", "--version", "2", *server_flags).stdout
            assert all(f"{url} now serves bert4rec version 1" in out for url in urls), out
            marks = [len(load.seen) for load in loads]
            wait_for(lambda: all(len(load.seen) > m + 20 for load, m in zip(loads, marks)), "answers after reject")
            assert all(load.versions_since(m) == {"1"} for load, m in zip(loads, marks)), \
                "every replica is back on v1 once reject returns"
        finally:
            for load in loads:
                load.stop.set()
            for load in loads:
                load.thread.join(30)
        for i, load in enumerate(loads):
            assert load.failures == [], f"replica {i}: {load.failures[:5]}"
            assert len(load.seen) > 100, f"replica {i} answered only {len(load.seen)} requests"

        # One replica down during an approve: the rollout stops there and says so per replica.
        servers[1].stop()
        run = recsys("approve", "--version", "2", *server_flags, expect=PARTIAL_ROLLOUT_EXIT)
        assert f"{urls[0]} now serves bert4rec version 2" in run.stdout, run.stdout
        assert f"{urls[1]} FAILED" in run.stdout, run.stdout
        assert "partial rollout: 1 of 2 replicas serve bert4rec version 2" in run.stderr, run.stderr
        assert "recsys approve --repository" in run.stderr, run.stderr
        # The dead replica first: by default the healthy one is left alone ...
        flipped = ["--server", urls[1], "--server", urls[0]]
        report = json.loads(recsys("reject", "--version", "2", *flipped, "--json",
                                   expect=PARTIAL_ROLLOUT_EXIT).stdout)["rollout"]
        assert [r["outcome"] for r in report["replicas"]] == ["failed", "not attempted"], report
        assert "Connection refused" in report["replicas"][0]["error"] or "connect" in report["replicas"][0]["error"]
        # ... and --rollout continue goes on to it.
        report = json.loads(recsys("reject", "--version", "2", *flipped, "--rollout", "continue", "--json",
                                   expect=PARTIAL_ROLLOUT_EXIT).stdout)["rollout"]
        assert [r["outcome"] for r in report["replicas"]] == ["failed", "serving"], report
        assert report["complete"] is False

    table = recsys("versions").stdout
    assert "rejected" in table and table.splitlines()[1].split()[:3] == ["1", "approved", "yes"], table


def test_convert_predict_and_export_read_and_write_object_storage(tmp_path, recsys_bin, s3):
    """The batch path of deploy/kubernetes/predict-job.yaml: an engine converted straight into the
    bucket, scored in two shards from there, the parts equal to a local run of the same engine."""
    from conftest import FIXTURES  # noqa: PLC0415

    src = FIXTURES / "bert4rec"
    engine_uri = s3.uri("models", "engines/bert4rec")

    def recsys(*args, expect=0):
        run = subprocess.run([str(recsys_bin), *args], capture_output=True, text=True, timeout=300)
        assert run.returncode == expect, f"{args}: exit {run.returncode}\n{run.stdout}\n{run.stderr}"
        return run

    convert_args = ["convert", "--kind", "bert4rec", "--checkpoint", str(src / "model.pt"),
                    "--config", str(src / "config.json"), "--item-map", str(src / "item_id_map.tsv"),
                    "--output", engine_uri]
    assert json.loads(recsys(*convert_args, "--json").stdout)["engine"] == engine_uri
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket="models", Prefix="engines/")["Contents"]}
    assert {"engines/bert4rec/manifest.json", "engines/bert4rec/weights.safetensors"} <= keys, keys
    assert "already holds objects" in recsys(*convert_args, expect=2).stderr

    users = tmp_path / "users.jsonl"
    histories = [[10011403, 10011207, 10011739], [10011207], [10011739, 10011403]] * 7
    users.write_text("".join(json.dumps({"user_id": i, "item_ids": h}) + "\n" for i, h in enumerate(histories)))
    s3.client().upload_file(str(users), "models", "batch/users.jsonl")
    for shard in range(2):
        recsys("predict", "--engine", engine_uri, "--input", s3.uri("models", "batch/users.jsonl"),
               "--output", s3.uri("models", f"batch/out/part-{shard}-of-2.jsonl"), "--shard", f"{shard}/2", "--k", "5")
    parts = [s3.client().get_object(Bucket="models", Key=f"batch/out/part-{i}-of-2.jsonl")["Body"].read().decode()
             for i in range(2)]
    remote = sorted((json.loads(line) for part in parts for line in part.splitlines()), key=lambda r: r["user_id"])

    local_engine = tmp_path / "engine"
    recsys(*convert_args[:-1], str(local_engine))
    local_out = tmp_path / "local.jsonl"
    recsys("predict", "--engine", str(local_engine), "--input", str(users), "--output", str(local_out), "--k", "5")
    local = [json.loads(line) for line in local_out.read_text().splitlines()]
    assert len(remote) == len(histories)
    assert remote == local, "scoring from object storage must give the local engine's answers"
    assert "--resume needs a local --output" in recsys(
        "predict", "--engine", engine_uri, "--input", str(users), "--output",
        s3.uri("models", "batch/out/again.jsonl"), "--resume", expect=2).stderr

    exported = json.loads(recsys("export-onnx", "--engine", str(local_engine), "--model-repository",
                                 s3.uri("models", "onnx"), "--model-name", "bert4rec_onnx", "--json").stdout)
    assert exported["path"] == s3.uri("models", "onnx") + "/bert4rec_onnx/1/model.onnx"
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket="models", Prefix="onnx/")["Contents"]}
    assert {"onnx/bert4rec_onnx/config.pbtxt", "onnx/bert4rec_onnx/item_ids.tsv",
            "onnx/bert4rec_onnx/1/model.onnx"} <= keys, keys


def test_concurrent_publishers_on_s3_get_distinct_versions(tmp_path, recsys_bin, s3):
    """No lock: four `recsys publish` processes started together against one s3:// model claim four
    distinct version numbers (create-if-absent records), all complete."""
    uri = s3.uri("models", "race")
    engine = tmp_path / "engine"
    convert(recsys_bin, "vaecf", "multivae", "model.safetensors", engine)
    base = ["--repository", uri, "--model", "vaecf", "--engine", str(engine), "--json"]
    first = subprocess.run([str(recsys_bin), "publish", "--approve", *base], capture_output=True, text=True,
                           timeout=120)
    assert first.returncode == 0, first.stderr
    racers = [subprocess.Popen([str(recsys_bin), "publish", *base], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(4)]
    outcomes = [p.communicate(timeout=120) for p in racers]
    assert all(p.returncode == 0 for p in racers), [err for _, err in outcomes]
    versions = sorted(json.loads(out)["version"] for out, _ in outcomes)
    assert versions == [2, 3, 4, 5], versions
    listed = json.loads(subprocess.run([str(recsys_bin), "versions", "--repository", uri, "--model", "vaecf",
                                        "--json"], capture_output=True, text=True, check=True).stdout)
    assert [v["status"] for v in listed["versions"]] == ["approved"] + ["pending"] * 4
    assert listed["config_versions"] == [1]
