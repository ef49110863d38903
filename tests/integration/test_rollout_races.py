"""Rollouts when more than one actor moves the fleet, on a real S3-compatible server with three
tritonservers (two traffic replicas under load, one canary outside them):
- an approve and a rollback started together: the rollback waits for the approve's lease, then
  runs; both exit 0 and the config, every replica and the canary end on the same version, with
  zero failed requests; a third command with --lease-wait 0 is refused naming the holder (exit 6);
- a replica added after the switch (a pod the autoscaler starts, which loads the new version from
  the config) is reached by the automatic rollback, through a replica list read again at every
  pass (--servers-file), as a headless Service's addresses are resolved again."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest

from conftest import convert
from s3_harness import CREDENTIALS, S3Server
from test_fleet import Load
from triton_harness import TritonServer

LEASE_HELD_EXIT = 6
ROLLED_BACK_EXIT = 5


@pytest.fixture
def s3(tmp_path, monkeypatch):
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    with S3Server(tmp_path / "moto.log") as server:
        server.client().create_bucket(Bucket="models")
        yield server


def ready_versions(url: str, model: str = "bert4rec") -> list[str]:
    with urllib.request.urlopen(f"{url}/v2/models/{model}", timeout=5) as r:
        return json.loads(r.read())["versions"]


def config_versions(s3, key: str) -> str:
    text = s3.client().get_object(Bucket="models", Key=key)["Body"].read().decode()
    return text.split("versions: [")[1].split("]")[0].strip()


def read_until(process: subprocess.Popen, needle: str, timeout: float = 120) -> str:
    """The process's stdout up to and including the first line holding `needle`."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"no line with {needle!r} within {timeout} s:\n{''.join(seen)}")


def fleet(tmp_path, uri, backend_dir, stack, n: int, name: str) -> list[str]:
    servers = [stack.enter_context(TritonServer(uri, backend_dir, explicit=True, load_models=["bert4rec"],
                                                log_path=tmp_path / f"{name}{i}.log"))
               for i in range(n)]
    return [f"http://{s.http_url}" for s in servers]


def engines_and_cli(tmp_path, recsys_bin, uri):
    """The fixture BERT4Rec at fp32 and int8 (distinguishable answers), and `recsys` on `uri`'s
    bert4rec model, asserting its exit status."""
    convert(recsys_bin, "bert4rec", "bert4rec", "model.pt", tmp_path / "fp32")
    convert(recsys_bin, "bert4rec", "bert4rec", "model.safetensors", tmp_path / "int8", extra=["--precision", "int8"])
    base = ["--repository", uri, "--model", "bert4rec"]

    def recsys(*args, expect=0):
        run = subprocess.run([str(recsys_bin), *args, *base], capture_output=True, text=True, timeout=300)
        assert run.returncode == expect, f"{args}: exit {run.returncode}\n{run.stdout}\n{run.stderr}"
        return run

    return base, recsys


def test_an_approve_and_a_rollback_started_together_end_on_one_version(tmp_path, recsys_bin, backend_dir, s3):
    uri = s3.uri("models", "race/repo")
    base, recsys = engines_and_cli(tmp_path, recsys_bin, uri)

    recsys("publish", "--approve", "--engine", str(tmp_path / "fp32"))
    recsys("publish", "--approve", "--engine", str(tmp_path / "int8"))
    recsys("publish", "--engine", str(tmp_path / "fp32"))
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(TritonServer(uri, backend_dir, explicit=True, load_models=["bert4rec"],
                                                    log_path=tmp_path / f"replica{i}.log"))
                   for i in range(3)]
        *traffic, canary = [f"http://{s.http_url}" for s in servers]
        flags = [f for url in traffic for f in ("--server", url)] + ["--canary", canary]
        assert all(ready_versions(url) == ["2"] for url in traffic)
        loads = [Load(s) for s in servers[:2]]
        for load in loads:
            load.thread.start()
        # CI approves v3 across the fleet ...
        approve = subprocess.Popen([str(recsys_bin), "approve", "--version", "3", *flags, *base],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            read_until(approve, "verifying bert4rec version 3")
            # ... while on-call rolls back, and a third operator will not wait.
            impatient = recsys("rollback", *flags, "--lease-wait", "0", expect=LEASE_HELD_EXIT)
            assert "approve --version 3" in impatient.stderr and "--force" in impatient.stderr, impatient.stderr
            rollback = subprocess.run([str(recsys_bin), "rollback", *flags, *base, "--json"],
                                      capture_output=True, text=True, timeout=300)
            approved_out, approved_err = approve.communicate(timeout=300)
        finally:
            if approve.poll() is None:
                approve.kill()
            Load.stop_all(loads)
        for i, load in enumerate(loads):
            assert load.failures == [], f"replica {i}: {load.failures[:5]}"
            assert len(load.seen) > 20 and set(load.seen) <= {"2", "3"}, (i, set(load.seen))
        assert approve.returncode == 0, approved_out + approved_err
        assert rollback.returncode == 0, rollback.stdout + rollback.stderr
        back = json.loads(rollback.stdout)
        # The rollback waited for the approve, then rolled the fleet back from 3 to 2.
        assert "approve --version 3" in back["waited_for_lease"], back
        assert back["serving_version_before"] == 3 and back["serving_version"] == 2, back
        assert back["reconciled"]["complete"] is True, back
        assert config_versions(s3, "race/repo/bert4rec/config.pbtxt") == "2"
        for url in [*traffic, canary]:
            assert ready_versions(url) == ["2"], url
        listed = {v["version"]: v["status"] for v in json.loads(recsys("versions", "--json").stdout)["versions"]}
        assert listed == {1: "approved", 2: "approved", 3: "rolled-back"}, listed
        assert json.loads(recsys("versions", "--json").stdout)["lease"] is None


def test_a_replica_added_after_the_switch_is_reached_by_the_automatic_rollback(
        tmp_path, recsys_bin, backend_dir, s3):
    uri = s3.uri("models", "grow/repo")
    base, recsys = engines_and_cli(tmp_path, recsys_bin, uri)

    recsys("publish", "--approve", "--engine", str(tmp_path / "fp32"))
    recsys("publish", "--engine", str(tmp_path / "int8"))
    with contextlib.ExitStack() as stack:
        healthy, canary = fleet(tmp_path, uri, backend_dir, stack, 2, "replica")
        # A replica that refuses reloads from this approver (its model control needs another key).
        refusing = stack.enter_context(TritonServer(
            uri, backend_dir, explicit=True, load_models=["bert4rec"], log_path=tmp_path / "refusing.log",
            extra_args=["--http-restricted-api=model-repository,model-config:recsys-admin-key=other"]))
        refusing_url = f"http://{refusing.http_url}"
        servers_file = tmp_path / "replicas.txt"
        servers_file.write_text(f"# the fleet, as service discovery writes it\n{healthy}\n{refusing_url}\n")
        approve = subprocess.Popen([str(recsys_bin), "approve", "--version", "2", "--servers-file", str(servers_file),
                                    "--canary", canary, "--json", *base],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # Hold the approve right after the switch (the config names v2) ...
            deadline = time.monotonic() + 120
            while config_versions(s3, "grow/repo/bert4rec/config.pbtxt") != "2":
                assert approve.poll() is None and time.monotonic() < deadline, approve.communicate()
                time.sleep(0.02)
            os.kill(approve.pid, signal.SIGSTOP)
            try:
                # ... while the autoscaler adds a pod: it loads v2, which the config names now.
                added = stack.enter_context(TritonServer(uri, backend_dir, explicit=True, load_models=["bert4rec"],
                                                         log_path=tmp_path / "added.log"))
                added_url = f"http://{added.http_url}"
                assert ready_versions(added_url) == ["2"]
                with servers_file.open("a") as f:
                    f.write(f"{added_url}\n")
            finally:
                os.kill(approve.pid, signal.SIGCONT)
            out, err = approve.communicate(timeout=300)
        finally:
            if approve.poll() is None:
                approve.kill()
        assert approve.returncode == ROLLED_BACK_EXIT, out + err
        outcome = json.loads(out)
        failed = [r for r in outcome["rollout"]["replicas"] if r["outcome"] == "failed"]
        assert [r["server"] for r in failed] == [refusing_url], outcome
        back = {r["server"]: r for r in outcome["rolled_back"]["replicas"]}
        assert back[added_url]["outcome"] == "serving" and back[added_url]["reloaded"] is True, outcome
        assert outcome["serving_version"] == 1 and outcome["reconciled"]["complete"] is True, outcome
        for url in (healthy, refusing_url, added_url, canary):
            assert ready_versions(url) == ["1"], url


def test_a_store_failure_after_the_switch_ends_in_its_own_exit_status_with_the_report(tmp_path, recsys_bin, s3):
    """The object store answers 403 ExpiredToken from the moment the config switched (a session
    token that expired mid-command): the reject exits 7, not 1, printing what it did (the config
    names v1) and what failed, with the command to run again."""
    from s3_harness import FaultyProxy  # noqa: PLC0415

    convert(recsys_bin, "bert4rec", "bert4rec", "model.pt", tmp_path / "fp32")
    direct = ["--repository", s3.uri("models", "faults/repo"), "--model", "bert4rec"]
    for _ in range(2):
        subprocess.run([str(recsys_bin), "publish", "--approve", "--engine", str(tmp_path / "fp32"), *direct],
                       check=True, capture_output=True, timeout=120)
    dead = f"http://127.0.0.1:{__import__('triton_harness').free_port()}"
    with FaultyProxy(s3.port, lambda method, path: method == "PUT" and path.endswith("/config.pbtxt")) as proxy:
        run = subprocess.run([str(recsys_bin), "reject", "--version", "2", "--server", dead, "--json",
                              "--repository", proxy.uri("models", "faults/repo"), "--model", "bert4rec"],
                             capture_output=True, text=True, timeout=120)
        assert proxy.failing.is_set(), proxy.forwarded
    assert run.returncode == 7, f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    report = json.loads(run.stdout)
    assert report["exit_code"] == 7, report
    failure = report["failed_after_switch"]
    assert "switched to version 1" in failure and "ExpiredToken" in failure, report
    assert config_versions(s3, "faults/repo/bert4rec/config.pbtxt") == "1"
    # Once the store answers again, the same command finishes.
    again = subprocess.run([str(recsys_bin), "reject", "--version", "2", "--server", dead, "--force", *direct],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 4, again.stdout + again.stderr  # the dead replica is unreachable
    assert "unreachable" in again.stdout, again.stdout


def test_a_replica_whose_load_outlasts_the_timeout_is_brought_back_by_the_rollback(
        tmp_path, recsys_bin, backend_dir, s3):
    """Replica b reaches the store through a slow link: its download of v2 takes longer than
    --reload-timeout, so the approve counts it failed and rolls back. Triton keeps serving v1 on
    b while it downloads and loads v2, and would switch to v2 when that ends; the rollback and
    the reconcile pass reload b anyway (it failed a pass: its state is not known), and a reload
    queues behind the one under way, then loads what the repository names. So b ends on v1 and
    stays there, instead of serving the rolled-back version for good."""
    from s3_harness import FaultyProxy  # noqa: PLC0415

    uri = s3.uri("models", "slow/repo")
    base, recsys = engines_and_cli(tmp_path, recsys_bin, uri)
    recsys("publish", "--approve", "--engine", str(tmp_path / "fp32"))
    recsys("publish", "--engine", str(tmp_path / "int8"))
    # The listing of v2's folder and each of its files take 2.7 s the first time b asks (below the
    # 3 s request timeout of tritonserver's S3 client, which would retry; it lists, then fetches
    # the files in parallel): b's load of v2 outlasts --reload-timeout, which leaves the canary's
    # and the other replica's loads ample time.
    slow_s = 2.7

    def slow(method: str, path: str) -> float:
        return slow_s if method == "GET" and ("/bert4rec/2/" in path or "bert4rec%2F2%2F" in path) else 0

    with FaultyProxy(s3.port, slow_once=slow) as proxy, \
            contextlib.ExitStack() as stack:
        a, canary = fleet(tmp_path, uri, backend_dir, stack, 2, "replica")
        b_server = stack.enter_context(TritonServer(proxy.uri("models", "slow/repo"), backend_dir, explicit=True,
                                                    load_models=["bert4rec"], log_path=tmp_path / "slow.log"))
        b = f"http://{b_server.http_url}"
        run = recsys("approve", "--version", "2", "--server", a, "--server", b, "--canary", canary,
                     "--reload-timeout", "5", "--json", expect=ROLLED_BACK_EXIT)
        outcome = json.loads(run.stdout)
        failed = {r["server"]: r for r in outcome["rollout"]["replicas"]}[b]
        assert failed["outcome"] == "failed" and "did not finish within 5s" in failed["error"], outcome
        assert proxy.slowed, "the slow link was never used"
        # Every later pass reloaded b rather than trusting the v1 it still showed.
        for later in ("rolled_back", "reconciled"):
            assert {r["server"]: r for r in outcome[later]["replicas"]}[b]["reloaded"] is True, outcome[later]
        assert outcome["serving_version"] == 1, outcome

        # Once the queued loads are over, b serves v1 (the version the repository names) and stays.
        def settled_on_v1() -> bool:
            return all(ready_versions(b) == ["1"] for _ in range(6) if not time.sleep(0.5))
        deadline = time.monotonic() + 60
        while not settled_on_v1():
            assert time.monotonic() < deadline, f"b serves {ready_versions(b)}, not v1"
        for url in (a, canary):
            assert ready_versions(url) == ["1"], url
