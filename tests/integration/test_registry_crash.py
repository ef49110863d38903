"""Crash safety of publish, approve (with its integrity gate), reject and rollback: each is killed with SIGKILL at a random moment (a
seeded generator, the seed printed) over a local directory and over a real S3-compatible server.
After every kill the repository must be one that every replica can load: config.pbtxt names one
version, that version is approved and complete (every file of its manifest present, with its size
and SHA-256), so a replica serves either the old or the new version, never a partial one. At the
end a real tritonserver loads the repository and answers from the version the config names."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import convert
from s3_harness import CREDENTIALS, S3Server
from triton_harness import TritonServer

KILLS_PER_STORE = 40
MODEL = "bert4rec"


class LocalReader:
    def __init__(self, root: Path):
        self.root = root

    def read(self, key: str) -> bytes | None:
        path = self.root / key
        return path.read_bytes() if path.is_file() else None


class S3Reader:
    def __init__(self, client, bucket: str, prefix: str):
        self.client, self.bucket, self.prefix = client, bucket, prefix

    def read(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None


def loadable_version(reader, *, settled: bool = False) -> int:
    """The version a replica loading the repository now would serve, checked complete. A command
    killed between its two writes (the record, then the config) may leave the config on the
    version it was switching away from: still complete, so a replica serves the old version;
    `settled` (after a command ran to its end) asks for the config to name an approved one."""
    config = reader.read(f"{MODEL}/config.pbtxt")
    assert config is not None, "config.pbtxt is missing"
    named = re.findall(r"version_policy:\s*\{\s*specific:\s*\{\s*versions:\s*\[\s*([0-9, ]+)\]", config.decode())
    assert len(named) == 1, f"config does not name exactly one policy:\n{config.decode()}"
    versions = [int(v) for v in named[0].split(",")]
    assert len(versions) == 1, versions
    version = versions[0]
    record = json.loads(reader.read(f"{MODEL}/{version}/recsys-version.json"))
    # Killed between its record write and its config write, a reject or rollback leaves the config
    # on the version it was taking off (rejected / rolled-back, still complete).
    allowed = ("approved",) if settled else ("approved", "rejected", "rolled-back")
    assert record["status"] in allowed, f"config names version {version}, which is {record['status']}"
    manifest_bytes = reader.read(f"{MODEL}/{version}/manifest.json")
    assert manifest_bytes is not None, f"version {version} has no manifest"
    for name, meta in json.loads(manifest_bytes)["files"].items():
        data = reader.read(f"{MODEL}/{version}/{name}")
        assert data is not None, f"version {version} lacks {name}"
        assert len(data) == meta["bytes"] and hashlib.sha256(data).hexdigest() == meta["sha256"], \
            f"version {version}: {name} is not the manifest's"
    return version


@pytest.mark.parametrize("store", ["local", "s3"])
def test_sigkill_at_any_moment_leaves_a_repository_every_replica_can_load(
        store, tmp_path, recsys_bin, backend_dir, monkeypatch):
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    s3 = None
    if store == "s3":
        s3 = S3Server(tmp_path / "moto.log").start()
        s3.client().create_bucket(Bucket="models")
        uri, reader = s3.uri("models", "crash"), S3Reader(s3.client(), "models", "crash")
    else:
        uri, reader = str(tmp_path / "repo"), LocalReader(tmp_path / "repo")
    try:
        engines = [tmp_path / "fp32", tmp_path / "int8"]
        convert(recsys_bin, "bert4rec", "bert4rec", "model.pt", engines[0])
        convert(recsys_bin, "bert4rec", "bert4rec", "model.safetensors", engines[1], extra=["--precision", "int8"])
        base = ["--repository", uri, "--model", MODEL]

        def run(*args):
            return subprocess.run([str(recsys_bin), *args, *base], capture_output=True, text=True, timeout=120)

        assert run("publish", "--approve", "--engine", str(engines[0])).returncode == 0
        assert loadable_version(reader, settled=True) == 1

        def versions():
            listed = run("versions", "--json")
            assert listed.returncode == 0, listed.stderr
            return json.loads(listed.stdout)["versions"]

        def next_command(i: int) -> list[str]:
            listed = versions()
            approved = [v["version"] for v in listed if v["status"] == "approved"]
            complete = [v["version"] for v in listed if v["status"] in ("pending", "rejected", "rolled-back")]
            step = i % 4
            if step == 0 or (step == 2 and not complete):
                return ["publish", "--engine", str(engines[i % 2])]
            if step == 1:
                return ["publish", "--approve", "--engine", str(engines[i % 2])]
            if step == 2:
                return ["approve", "--version", str(complete[-1])]
            if len(approved) > 1:
                return ["reject", "--version", str(max(approved))] if i % 8 == 3 else ["rollback"]
            return ["publish", "--approve", "--engine", str(engines[0])]

        # How long each command takes when left alone: kills land anywhere inside that span.
        durations = {}
        for verb in ("publish", "approve", "reject", "rollback"):
            if verb == "rollback":
                assert run("approve", "--version", str(versions()[-1]["version"])).returncode == 0
            args = {"publish": ["publish", "--engine", str(engines[1])],
                    "approve": ["approve", "--version", str(versions()[-1]["version"])],
                    "reject": ["reject", "--version", str(versions()[-1]["version"])],
                    "rollback": ["rollback"]}[verb]
            started = time.monotonic()
            done = run(*args)
            assert done.returncode == 0, done.stderr
            durations[verb] = time.monotonic() - started
            loadable_version(reader, settled=True)

        seed = int(os.environ.get("RECSYS_CRASH_SEED", random.SystemRandom().randrange(1 << 30)))
        print(f"store {store}: seed {seed} (RECSYS_CRASH_SEED reproduces), durations {durations}")
        rng = random.Random(seed)
        killed_mid_command = 0
        for i in range(KILLS_PER_STORE):
            command = next_command(i)
            delay = rng.uniform(0.0, durations[command[0]])
            # The command before was killed or ended: its lease, if any, is a dead holder's.
            process = subprocess.Popen([str(recsys_bin), *command, *base, "--force"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(delay)
            if process.poll() is None:
                killed_mid_command += 1
                process.send_signal(signal.SIGKILL)
            process.wait(30)
            try:
                loadable_version(reader)
            except AssertionError as e:
                raise AssertionError(f"after killing {command} at {delay:.3f} s (seed {seed}): {e}") from e
        assert killed_mid_command >= KILLS_PER_STORE // 3, f"only {killed_mid_command} kills landed mid-command"
        print(f"store {store}: {killed_mid_command} of {KILLS_PER_STORE} kills landed mid-command")

        # The repository still works for the registry: listing, publishing and approving.
        listed = versions()
        incomplete = [v["version"] for v in listed if v["status"] == "incomplete"]
        print(f"store {store}: versions {[(v['version'], v['status']) for v in listed]}")
        final = run("publish", "--approve", "--engine", str(engines[0]), "--force")
        assert final.returncode == 0, final.stderr
        expected = loadable_version(reader, settled=True)
        assert expected == max(v["version"] for v in versions() if v["status"] == "approved")
        assert expected not in incomplete

        # And a real replica loads it and serves the version the config names.
        with TritonServer(uri if store == "s3" else Path(uri), backend_dir, explicit=True, load_models=[MODEL],
                          log_path=tmp_path / "server.log") as server:
            inp = httpclient.InferInput("ITEM_IDS", [1, 3], "INT64")
            inp.set_data_from_numpy(np.array([[10011403, 10011207, 10011739]], dtype=np.int64))
            answer = httpclient.InferenceServerClient(server.http_url).infer(MODEL, [inp]).get_response()
            assert answer["model_version"] == str(expected)
    finally:
        if s3 is not None:
            s3.stop()
