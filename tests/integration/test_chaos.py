"""The release path's fault-injection suite (tests/integration/chaos.py): a bounded number of
seeds in CI (RECSYS_CHAOS_SEEDS, 1 by default: seeds whose schedule waits out lease lifetimes
take minutes each; `scripts/chaos.sh --seeds 500` is the long run),
each a random schedule of release commands, replica crashes and store faults against real
tritonservers and a real S3-compatible store, with no invariant violated."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from chaos import Simulation
from conftest import convert
from s3_harness import CREDENTIALS, S3Server
from triton_harness import ROOT

SEEDS = int(os.environ.get("RECSYS_CHAOS_SEEDS", "1"))


@pytest.fixture(scope="module")
def chaos_bin() -> Path:
    path = Path(os.environ.get("RECSYS_CHAOS_BIN", ROOT / "build" / "chaos" / "recsys"))
    if not path.exists():
        pytest.fail(f"{path} is missing: scripts/test.sh builds it (recsys with --features fault-injection)")
    return path


@pytest.fixture(scope="module")
def engines(tmp_path_factory, recsys_bin) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("engines")
    convert(recsys_bin, "bert4rec", "bert4rec", "model.pt", out / "fp32")
    convert(recsys_bin, "bert4rec", "bert4rec", "model.safetensors", out / "int8", extra=["--precision", "int8"])
    return {"fp32": out / "fp32", "int8": out / "int8"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    with S3Server(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        server.client().create_bucket(Bucket="models")
        yield server
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_the_fault_hooks_are_absent_from_the_shipped_build(recsys_bin, chaos_bin, tmp_path):
    """The plain `recsys` never reads RECSYS_FAULTS; the chaos build refuses a plan it cannot read
    (so a typo in a schedule is not a silently fault-free run)."""
    import subprocess  # noqa: PLC0415

    env = {**os.environ, "RECSYS_FAULTS": "no-such-fault=1"}
    plain = subprocess.run([str(recsys_bin), "versions", "--repository", str(tmp_path), "--model", "m"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert "RECSYS_FAULTS" not in plain.stderr, plain.stderr
    chaos = subprocess.run([str(chaos_bin), "rollback", "--repository", str(tmp_path), "--model", "m"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert "unknown fault" in chaos.stderr, chaos.stderr


@pytest.mark.parametrize("seed", range(1, SEEDS + 1))
def test_the_release_path_keeps_its_invariants_under_faults(seed, tmp_path, chaos_bin, backend_dir, store, engines):
    outcome = Simulation(seed, tmp_path, chaos_bin, backend_dir, store, engines).run()
    report = json.dumps(outcome.to_json(), indent=1) + f"\nreplay: scripts/chaos.sh --seed {seed}"
    print(report)
    assert outcome.violations == [], report
    assert sum(outcome.faults.values()) > 0, report
    assert outcome.answers > 50, report
