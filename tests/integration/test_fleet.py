"""A fleet on object storage: two tritonservers (explicit model control) load the same s3://
repository from a real S3-compatible server on 127.0.0.1. Under continuous load on both replicas:
publish v2 (pending: v1 keeps serving), approve it (both replicas serve v2), reject it (both back on
v1), with zero failed requests. Then one replica down during an approve: unreachable, not failed
(no rollback), the reachable replica on the new version and exit 4. And the gates, with the canary
a third tritonserver outside the traffic replicas: corrupted and self-check-failing versions refused
with nothing changed and no traffic replica ever answering from them, a rollout broken by a replica
that refuses the reload undone over the whole fleet, rollback and prune."""

from __future__ import annotations

import contextlib
import os
import json
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import FIXTURES, convert
from s3_harness import CREDENTIALS, S3Server
from triton_harness import TritonServer

REFUSED_EXIT = 3
PARTIAL_ROLLOUT_EXIT = 4
ROLLED_BACK_EXIT = 5


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

    @staticmethod
    def stop_all(loads: list["Load"]) -> None:
        """Stops every load's thread and waits for it (bounded)."""
        for load in loads:
            load.stop.set()
        for load in loads:
            load.thread.join(30)


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

            approved = json.loads(recsys("approve", "--version", "2", *server_flags, "--canary-on-traffic",
                                         "--json").stdout)
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
            Load.stop_all(loads)
        for i, load in enumerate(loads):
            assert load.failures == [], f"replica {i}: {load.failures[:5]}"
            assert len(load.seen) > 100, f"replica {i} answered only {len(load.seen)} requests"

        # One replica down during an approve (a pod terminating, or not started): unreachable, not
        # a load failure, so no rollback; the live one moves and exit 4 says not every replica did.
        servers[1].stop()
        run = recsys("approve", "--version", "2", *server_flags, "--canary-on-traffic",
                     expect=PARTIAL_ROLLOUT_EXIT)
        assert f"canary {urls[0]} loaded the version and passed its self-check" in run.stdout, run.stdout
        assert f"{urls[0]} now serves bert4rec version 2" in run.stdout, run.stdout
        assert f"{urls[1]} unreachable" in run.stdout, run.stdout
        assert "rolling back" not in run.stdout, run.stdout
        assert "partial rollout: 1 of 2 replicas serve bert4rec version 2" in run.stderr, run.stderr
        assert "recsys approve --repository" in run.stderr, run.stderr
        assert ready_versions(servers[0]) == ["2"]
        # The unreachable replica first: it does not stop the rollout, the healthy one goes back.
        flipped = ["--server", urls[1], "--server", urls[0]]
        outcome = json.loads(recsys("reject", "--version", "2", *flipped, "--json",
                                    expect=PARTIAL_ROLLOUT_EXIT).stdout)
        assert [r["outcome"] for r in outcome["rollout"]["replicas"]] == ["unreachable", "serving"], outcome
        assert "not live" in outcome["rollout"]["replicas"][0]["error"], outcome
        assert outcome["reconciled"]["complete"] is False, outcome
        assert ready_versions(servers[0]) == ["1"]

    table = recsys("versions").stdout
    assert "rejected" in table and table.splitlines()[1].split()[:3] == ["1", "approved", "yes"], table


def ready_versions(server: TritonServer, model: str = "bert4rec") -> list[str]:
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}", timeout=5) as r:
        return json.loads(r.read())["versions"]


def overflowing_checkpoint(out: Path) -> Path:
    """The BERT4Rec fixture with its output LayerNorm's gain blown up to +-1e38: every weight finite
    (the importer accepts it), every score infinite or NaN, as a diverged training run gives."""
    src = (FIXTURES / "bert4rec" / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", src[:8])[0]
    header = json.loads(src[8:8 + n])
    data = bytearray(src[8 + n:])
    start, end = header["output_ln.weight"]["data_offsets"]
    original = np.frombuffer(bytes(data[start:end]), dtype="<f4")
    gain = np.where(original < 0, np.float32(-1e38), np.float32(1e38)).astype("<f4")
    assert np.isfinite(gain).all()
    data[start:end] = gain.astype("<f4").tobytes()
    out.write_bytes(src[:8 + n] + bytes(data))
    return out


def biased_checkpoint(out: Path) -> Path:
    """The BERT4Rec fixture with every output bias at float32's largest finite value: every score
    is that same finite number (the ranking means nothing), every weight finite, and the
    publisher's own engine gives the same answer as any replica, so integrity and the self-check
    pass; only the quality gate can tell."""
    src = (FIXTURES / "bert4rec" / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", src[:8])[0]
    header = json.loads(src[8:8 + n])
    data = bytearray(src[8 + n:])
    start, end = header["output_bias"]["data_offsets"]
    data[start:end] = np.full((end - start) // 4, 3.4e38, dtype="<f4").tobytes()
    out.write_bytes(src[:8 + n] + bytes(data))
    return out


def test_a_bad_version_never_serves_and_a_broken_rollout_rolls_back(tmp_path, recsys_bin, backend_dir, s3):
    """Two traffic replicas under load and a canary replica outside them, on one s3:// repository.
    A version with a flipped byte in the bucket, a version that loads but answers non-finite scores
    and a version whose finite scores are all the same number (output bias at float32's top) are
    all refused by approve (integrity, self-check, quality gate): zero failed requests, no traffic
    replica ever answering from any of them, the repository unchanged, and a fourth tritonserver
    started afterwards with default flags serves v1. A good version then approves normally, its
    NDCG@10 compared with v1's on v1's held-out histories, and a rollout broken mid-way (a replica
    that refuses the reload) rolls back by itself, over every replica."""
    uri = s3.uri("models", "gated/repo")
    convert(recsys_bin, "bert4rec", "bert4rec", "model.pt", tmp_path / "fp32")
    convert(recsys_bin, "bert4rec", "bert4rec", "model.safetensors", tmp_path / "int8", extra=["--precision", "int8"])
    src = FIXTURES / "bert4rec"
    subprocess.run([str(recsys_bin), "convert", "--force", "--kind", "bert4rec",
                    "--checkpoint", str(overflowing_checkpoint(tmp_path / "overflow.safetensors")),
                    "--config", str(src / "config.json"), "--item-map", str(src / "item_id_map.tsv"),
                    "--output", str(tmp_path / "overflow")], check=True, capture_output=True, timeout=300)
    subprocess.run([str(recsys_bin), "convert", "--force", "--kind", "bert4rec",
                    "--checkpoint", str(biased_checkpoint(tmp_path / "biased.safetensors")),
                    "--config", str(src / "config.json"), "--item-map", str(src / "item_id_map.tsv"),
                    "--output", str(tmp_path / "biased")], check=True, capture_output=True, timeout=300)

    def recsys(*args, expect=0):
        run = subprocess.run([str(recsys_bin), *args, "--repository", uri, "--model", "bert4rec"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == expect, f"{args}: exit {run.returncode}\n{run.stdout}\n{run.stderr}"
        return run

    def config_text() -> bytes:
        return s3.client().get_object(Bucket="models", Key="gated/repo/bert4rec/config.pbtxt")["Body"].read()

    # v1 carries the held-out histories every later candidate is compared on.
    recsys("publish", "--approve", "--engine", str(tmp_path / "fp32"), "--eval-set", str(FIXTURES / "test_set.tsv"))
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(TritonServer(uri, backend_dir, explicit=True, load_models=["bert4rec"],
                                                    log_path=tmp_path / f"replica{i}.log"))
                   for i in range(3)]
        canary = servers.pop()
        canary_url = f"http://{canary.http_url}"
        urls = [f"http://{s.http_url}" for s in servers]
        server_flags = [flag for url in urls for flag in ("--server", url)] + ["--canary", canary_url]
        loads = [Load(s) for s in servers]
        for load in loads:
            load.thread.start()
        try:
            wait_for(lambda: all(len(load.seen) > 5 for load in loads), "both replicas answering")
            config_v1 = config_text()

            # v2: one byte flipped in the bucket after the publish.
            recsys("publish", "--engine", str(tmp_path / "int8"))
            key = "gated/repo/bert4rec/2/weights.safetensors"
            body = bytearray(s3.client().get_object(Bucket="models", Key=key)["Body"].read())
            body[len(body) // 2] ^= 0x01
            s3.client().put_object(Bucket="models", Key=key, Body=bytes(body))
            run = recsys("approve", "--version", "2", *server_flags, expect=REFUSED_EXIT)
            assert "weights.safetensors: SHA-256" in run.stderr and "nothing changed" in run.stderr, run.stderr
            assert "canary" not in run.stdout, "the integrity gate runs before any replica is touched"
            assert config_text() == config_v1

            # v3: loads, but every score overflows: the canary's self-check refuses it.
            recsys("publish", "--engine", str(tmp_path / "overflow"))
            run = recsys("approve", "--version", "3", *server_flags, "--json", expect=REFUSED_EXIT)
            outcome = json.loads(run.stdout)
            assert outcome["canary"]["server"] == canary_url and outcome["canary"]["restored"] is True, outcome
            assert "non-finite score" in outcome["refused"], outcome
            assert config_text() == config_v1
            assert all(ready_versions(s) == ["1"] for s in [*servers, canary])
            listed = json.loads(recsys("versions", "--json").stdout)["versions"]
            assert [v["status"] for v in listed] == ["approved", "pending", "pending"], listed
            assert "SHA-256" in listed[1]["last_failure"] and "self-check" in listed[2]["last_failure"], listed
            table = recsys("versions").stdout
            assert "approve refused" in table, table

            # v4: finite scores, all the same number: integrity and the self-check pass, the quality
            # gate refuses it (degenerate), with both versions' numbers recorded.
            recsys("publish", "--engine", str(tmp_path / "biased"))
            run = recsys("approve", "--version", "4", *server_flags, expect=REFUSED_EXIT)
            assert "quality gate: version 4 NDCG@10" in run.stdout and "REFUSED" in run.stdout, run.stdout
            assert "degenerate scores" in run.stderr, run.stderr
            quality = json.loads(recsys("versions", "--json").stdout)["versions"][3]["quality"]
            assert quality["candidate"]["degenerate_share"] > 0.9 and quality["serving"]["version"] == 1, quality
            assert quality["serving"]["ndcg_at_10"] > 0.1 and quality["candidate"]["histories"] == 500, quality
            assert config_text() == config_v1
            assert all(ready_versions(s) == ["1"] for s in [*servers, canary])

            # A replica started now, with tritonserver's default flags, serves v1.
            with TritonServer(uri, backend_dir, log_path=tmp_path / "fresh.log") as fresh:
                assert ready_versions(fresh) == ["1"]

            # A good version approves normally: int8 ranks v1's held-out histories within 5 % of fp32.
            recsys("publish", "--engine", str(tmp_path / "int8"))
            approved = json.loads(recsys("approve", "--version", "5", *server_flags, "--json").stdout)
            assert approved["canary"]["passed"] is True and approved["rollout"]["complete"] is True, approved
            judged = approved["canary"]["quality"]
            assert judged["refused"] is None and judged["candidate"]["degenerate_share"] == 0.0, judged
            assert judged["candidate"]["ndcg_at_10"] >= 0.95 * judged["serving"]["ndcg_at_10"], judged
            assert approved["serving_version"] == 5
            marks = [len(load.seen) for load in loads]
            wait_for(lambda: all(len(load.seen) > m + 20 for load, m in zip(loads, marks)), "answers after approve")
            assert all(load.versions_since(m) == {"5"} for load, m in zip(loads, marks))
        finally:
            Load.stop_all(loads)
        for i, load in enumerate(loads):
            assert load.failures == [], f"replica {i}: {load.failures[:5]}"
            # The candidates loaded on the canary only: no client of a traffic replica ever got an
            # answer from the corrupted or the overflowing version.
            assert set(load.seen) <= {"1", "5"}, f"replica {i} answered from {set(load.seen)}"

        # A rollout broken mid-way: replica 1 restarted with its model control restricted to a key
        # this approver lacks, so it refuses the reload; the approve of v5 rolls back to v4 by
        # itself, and the pass back reaches every replica (replica 1 never left v5).
        recsys("publish", "--engine", str(tmp_path / "fp32"))
        servers[1].stop()
        servers[1] = stack.enter_context(TritonServer(
            uri, backend_dir, explicit=True, load_models=["bert4rec"], log_path=tmp_path / "restricted.log",
            extra_args=["--http-restricted-api=model-repository,model-config:recsys-admin-key=other"]))
        urls[1] = f"http://{servers[1].http_url}"
        server_flags = [flag for url in urls for flag in ("--server", url)] + ["--canary", canary_url]
        run = recsys("approve", "--version", "6", *server_flags, "--json", expect=ROLLED_BACK_EXIT)
        outcome = json.loads(run.stdout)
        # v6 and the serving v5 carry no evaluation set: the gate used v1's, the newest that has one.
        assert "version 1's evaluation set" in outcome["canary"]["quality"]["source"], outcome["canary"]
        assert [r["outcome"] for r in outcome["rollout"]["replicas"]] == ["serving", "failed"], json.dumps(outcome, indent=1)
        assert [r["outcome"] for r in outcome["rolled_back"]["replicas"]] == ["serving", "serving"], outcome
        assert [r["reloaded"] for r in outcome["rolled_back"]["replicas"]] == [True, False], outcome
        assert outcome["serving_version"] == 5 and outcome["rolled_back"]["version"] == 5, outcome
        assert outcome["reconciled"]["complete"] is True, outcome
        assert canary_url in [r["server"] for r in outcome["reconciled"]["replicas"]], outcome
        assert all(ready_versions(s) == ["5"] for s in [*servers, canary])
        assert b"versions: [ 5 ]" in config_text()
        listed = json.loads(recsys("versions", "--json").stdout)["versions"]
        assert listed[5]["status"] == "rolled-back" and urls[1] in listed[5]["last_failure"], listed[5]

        # Explicit rollback to v1 (v5 marked rolled back), then prune keeps what may serve.
        back = json.loads(recsys("rollback", "--to", "1", "--server", urls[0], "--json").stdout)
        assert back["serving_version"] == 1 and back["rollout"]["complete"] is True, back
        assert ready_versions(servers[0]) == ["1"]
        # Replica 1 (which refuses reloads) and the canary still have v5 loaded: prune keeps it.
        every = ["--server", urls[0], "--server", urls[1], "--server", canary_url]
        pruned = json.loads(recsys("versions", "--prune", "--keep", "1", *every, "--json").stdout)
        assert pruned["removed"] == [], pruned
        assert {"version": 5, "why": "loaded on a replica"} in pruned["kept"], pruned
        assert sorted(k["version"] for k in pruned["kept"]) == [1, 2, 3, 4, 5], pruned


def test_a_replica_without_a_loadable_model_stays_up_and_recovers_at_the_next_approve(
        tmp_path, recsys_bin, backend_dir, s3):
    """Started with serve.sh's and the manifests' flags (--exit-on-error=false, strict readiness)
    on a repository with nothing approved yet (a fresh cluster: apply, then publish), a replica is
    alive without the model, and the first `publish --approve --server` makes it ready; started again
    after its version rotted in the bucket, it is alive and not ready with the reason in its log;
    a degenerate candidate is refused by the quality gate (the rotted version cannot be compared
    with) and the canary, unable to go back to the rotted version, is reported stranded (exit 8,
    recorded on the version); the next approve's reload has it serve a good version at once, and (Triton keeping the old
    version's failed load in its readiness) a restart, which the manifests' liveness probe on
    readiness makes after 10 minutes, is ready on it."""
    uri = s3.uri("models", "startup/repo")
    convert(recsys_bin, "bert4rec", "bert4rec", "model.pt", tmp_path / "fp32")
    flags = ["--exit-on-error=false", "--strict-readiness=true"]
    # The repository exists (tritonserver is not even live on a path that does not), with no model.
    s3.client().put_object(Bucket="models", Key="startup/repo/README", Body=b"recsys model repository\n")

    def recsys(*args, expect=0):
        run = subprocess.run([str(recsys_bin), *args, "--repository", uri, "--model", "bert4rec"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == expect, f"{args}: exit {run.returncode}\n{run.stdout}\n{run.stderr}"
        return run

    server = TritonServer(uri, backend_dir, explicit=True, load_models=["bert4rec"],
                          log_path=tmp_path / "first.log", extra_args=flags).start(until="live")
    try:
        time.sleep(1)
        # Up, and the model not ready. (Triton counts a model it never found as no model, so the
        # server itself reads ready here; a model that fails to load makes it unready, below.)
        assert server.process.poll() is None and server.is_live()
        assert server._get("/v2/models/bert4rec/ready") != 200
        recsys("publish", "--approve", "--engine", str(tmp_path / "fp32"), "--server", f"http://{server.http_url}",
               "--canary-on-traffic")
        wait_for(server.is_ready, "the replica ready after the first approve", timeout=30)
        assert ready_versions(server) == ["1"]
    finally:
        server.stop()

    key = "startup/repo/bert4rec/1/weights.safetensors"
    body = bytearray(s3.client().get_object(Bucket="models", Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x01
    s3.client().put_object(Bucket="models", Key=key, Body=bytes(body))
    server = TritonServer(uri, backend_dir, explicit=True, load_models=["bert4rec"],
                          log_path=tmp_path / "second.log", extra_args=flags).start(until="live")
    try:
        time.sleep(2)
        assert server.process.poll() is None, "the replica exited on a model it cannot load"
        assert server.is_live() and not server.is_ready()
        assert "sha256" in server.log().lower() or "checksum" in server.log().lower(), server.log()[-2000:]
        # A degenerate candidate is refused, and the canary cannot be put back on the rotted v1:
        # exit 8, recorded on the version, rather than "nothing changed".
        src = FIXTURES / "bert4rec"
        subprocess.run([str(recsys_bin), "convert", "--force", "--kind", "bert4rec",
                        "--checkpoint", str(biased_checkpoint(tmp_path / "biased.safetensors")),
                        "--config", str(src / "config.json"), "--item-map", str(src / "item_id_map.tsv"),
                        "--output", str(tmp_path / "biased")], check=True, capture_output=True, timeout=300)
        stranded = recsys("publish", "--approve", "--engine", str(tmp_path / "biased"), "--server",
                          f"http://{server.http_url}", "--canary-on-traffic", expect=8)
        assert "degenerate scores" in stranded.stdout and "could not be put back" in stranded.stderr, stranded
        listed = json.loads(recsys("versions", "--json").stdout)["versions"]
        assert listed[1]["status"] == "pending" and "could not be put back" in listed[1]["last_failure"], listed[1]
        assert "could not be scored" in listed[1]["quality"]["serving_unscored"], listed[1]
        started = time.monotonic()
        out = recsys("publish", "--approve", "--engine", str(tmp_path / "fp32"), "--server",
                     f"http://{server.http_url}", "--canary-on-traffic").stdout
        # The canary could not be put back on the rotted version; it says so at once.
        assert "not put back: version 1 failed to load" in out and "checksum mismatch" in out, out
        assert time.monotonic() - started < 60, "a failed load is reported when it happens, not after a timeout"
        assert ready_versions(server) == ["3"]
        assert server._get("/v2/models/bert4rec/ready") == 200
        # Triton keeps version 1's failed load in its strict readiness until the process restarts:
        # the manifests' liveness probe on readiness (10 minutes) is that bounded retry.
        assert not server.is_ready()
    finally:
        server.stop()
    with TritonServer(uri, backend_dir, explicit=True, load_models=["bert4rec"],
                      log_path=tmp_path / "restarted.log", extra_args=flags) as restarted:
        assert ready_versions(restarted) == ["3"]


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


def manifest_restricted_flags(key: str) -> list[str]:
    """The restricted-API flags of deploy/kubernetes/base/serving/deployment.yaml, with `key` in
    place of the mounted key file's reference (which the preloaded library resolves in the pod)."""
    import yaml  # noqa: PLC0415

    from triton_harness import ROOT  # noqa: PLC0415

    deployment = next(d for d in yaml.safe_load_all(
        (ROOT / "deploy" / "kubernetes" / "base" / "serving" / "deployment.yaml").read_text()) if d)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = [a.replace("@file:/var/run/secrets/recsys-admin/key", key) for a in args
             if a.startswith(("--http-restricted-api=", "--grpc-restricted-protocol="))]
    assert len(flags) == 2, args
    return flags


def test_model_control_restricted_to_the_approvers_key(tmp_path, recsys_bin, backend_dir):
    """tritonserver with the manifests' restricted APIs (model repository, model config, logging,
    trace, shared memory) behind a key: an approve without the key is refused by the canary with
    nothing changed; with RECSYS_TRITON_ADMIN_KEY (or _FILE, as the approver's Secret is mounted)
    it rolls out. A client without the key cannot raise the log level, trace requests or register
    shared memory, and still gets its answers."""
    repo = tmp_path / "repo"
    convert(recsys_bin, "bert4rec", "bert4rec", "model.pt", tmp_path / "fp32")
    base = ["--repository", str(repo), "--model", "bert4rec"]

    def recsys(*args, expect=0, env=None):
        run = subprocess.run([str(recsys_bin), *args, *base], capture_output=True, text=True, timeout=300,
                             env={**os.environ, **(env or {})})
        assert run.returncode == expect, f"{args}: exit {run.returncode}\n{run.stdout}\n{run.stderr}"
        return run

    recsys("publish", "--approve", "--engine", str(tmp_path / "fp32"))
    recsys("publish", "--engine", str(tmp_path / "fp32"))
    restricted = manifest_restricted_flags("s3cret")
    with TritonServer(repo, backend_dir, explicit=True, load_models=["bert4rec"],
                      log_path=tmp_path / "server.log", extra_args=restricted) as server:
        url = f"http://{server.http_url}"

        def call(path: str, body: dict | None, key: str | None) -> int:
            request = urllib.request.Request(f"{url}{path}", method="POST" if body is not None else "GET",
                                             data=None if body is None else json.dumps(body).encode(),
                                             headers={"recsys-admin-key": key} if key else {})
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    return response.status
            except urllib.error.HTTPError as e:
                return e.code

        operations = [("/v2/logging", {"log_verbose_level": 1}), ("/v2/logging", None),
                      ("/v2/trace/setting", {"trace_rate": "1"}), ("/v2/trace/setting", None),
                      ("/v2/systemsharedmemory/status", None),
                      ("/v2/systemsharedmemory/region/x/register", {"key": "/x", "offset": 0, "byte_size": 8})]
        for path, body in operations:
            assert call(path, body, None) in (401, 403), path
            assert call(path, body, "wrong") in (401, 403), path
        assert call("/v2/logging", None, "s3cret") == 200
        assert call("/v2/trace/setting", None, "s3cret") == 200
        # gRPC: the restricted protocols want the key as `triton-grpc-protocol-<header>` metadata.
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        with pytest.raises(Exception, match="restricted"):
            grpc.update_log_settings({"log_verbose_level": 1})
        with pytest.raises(Exception, match="restricted"):
            grpc.get_trace_settings()
        allowed = {"triton-grpc-protocol-recsys-admin-key": "s3cret"}
        assert grpc.get_log_settings(headers=allowed) is not None
        # Inference, health and metadata stay open.
        history = np.array([[10011403, 10011207]], dtype=np.int64)
        inp = httpclient.InferInput("ITEM_IDS", [1, 2], "INT64")
        inp.set_data_from_numpy(history)
        assert httpclient.InferenceServerClient(server.http_url).infer("bert4rec", [inp]).as_numpy("TOP_ITEM_IDS").size
        assert call("/v2/health/ready", None, None) == 200
        run = recsys("approve", "--version", "2", "--canary", url, expect=3)
        assert "recsys-admin-key" in run.stderr, run.stderr
        assert ready_versions(server) == ["1"]
        recsys("approve", "--version", "2", "--canary", url, env={"RECSYS_TRITON_ADMIN_KEY": "wrong"}, expect=3)
        key_file = tmp_path / "admin-key"
        key_file.write_text("s3cret\n")
        recsys("approve", "--version", "2", "--canary", url, env={"RECSYS_TRITON_ADMIN_KEY_FILE": str(key_file)})
        assert ready_versions(server) == ["2"]
