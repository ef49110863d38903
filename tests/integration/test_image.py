"""The CPU runtime image (docker/Dockerfile.cpu, built by scripts/build-image.sh with podman from a
Debian 12 base and the tritonserver of PyPI's nvidia-pytriton), run as the Kubernetes manifests
run the pod: uid 10001, read-only root filesystem, every capability dropped, no new privileges,
/tmp and /models-cache as tmpfs, the model repository mounted read-only, tritonserver with the
manifests' flags. It must pass its HEALTHCHECK, serve the demo BERT4Rec and answer a request as
the same engine answers outside the container. Skipped, saying so, where podman is missing
(scripts/python-env.sh installs podman, runc and mmdebstrap as root)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import convert
from triton_harness import ROOT, TritonServer, free_port

PODMAN = ["podman", "--runtime", "runc"]
ULIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("podman") is None or shutil.which("runc") is None:
        pytest.skip("podman and runc are not installed (sudo apt-get install podman runc mmdebstrap): "
                    "the image is not built or run here")
    run = subprocess.run([str(ROOT / "scripts" / "build-image.sh"), "localhost/recsys-triton-cpu:test"],
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


def test_the_image_serves_the_demo_model_as_the_pod_runs_it(tmp_path, recsys_bin, backend_dir, image):
    inspected = json.loads(subprocess.run([*PODMAN, "image", "inspect", image], capture_output=True, text=True,
                                          check=True).stdout)[0]
    assert inspected["Config"]["User"] == "10001:10001", inspected["Config"]
    assert "/v2/health/live" in " ".join(inspected["Healthcheck"]["Test"]), "the image has no HEALTHCHECK"
    # The image preloads the secret-arguments library itself: run without the manifests' env
    # (below), tritonserver still gets the key from its file, never the public reference.
    assert "LD_PRELOAD=/opt/tritonserver/lib/librecsys_secret_args.so" in inspected["Config"]["Env"], inspected

    repo = tmp_path / "repo"
    (repo / "bert4rec").mkdir(parents=True)
    shutil.copy(ROOT / "model_repository" / "bert4rec" / "config.pbtxt", repo / "bert4rec" / "config.pbtxt")
    convert(recsys_bin, "bert4rec", "bert4rec", "model.pt", repo / "bert4rec" / "1")
    repo.chmod(0o755)
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    name = f"recsys-image-test-{uuid.uuid4().hex[:8]}"
    # The approver's key as the Secret is mounted (a file, read-only).
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    key = uuid.uuid4().hex
    (secrets / "key").write_text(key + "\n")
    secrets.chmod(0o755)
    (secrets / "key").chmod(0o444)
    # The manifests' flags (deploy/kubernetes/base/serving/deployment.yaml) but the ports, on the
    # host's loopback only; the key from its file through the preloaded library, as they run it.
    restricted = "model-repository,model-config,logging,trace,shared-memory:recsys-admin-key=@file:/var/run/secrets/recsys-admin/key"
    command = ["tritonserver", "--model-repository=/models", "--model-control-mode=explicit",
               "--load-model=bert4rec", "--exit-on-error=false", "--strict-readiness=true",
               "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
               f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
               "--exit-timeout-secs=30", "--pinned-memory-pool-byte-size=0",
               f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]
    run = subprocess.run([*PODMAN, "run", "--detach", "--name", name, *ULIMITS, "--network", "host",
                          "--user", "10001:10001", "--read-only", "--cap-drop", "ALL",
                          "--security-opt", "no-new-privileges",
                          "--tmpfs", "/tmp:rw,size=256m,mode=1777", "--tmpfs", "/models-cache:rw,size=256m,mode=1777",
                          "--volume", f"{repo}:/models:ro", "--env", f"HEALTH_PORT={http_port}",
                          "--volume", f"{secrets}:/var/run/secrets/recsys-admin:ro",
                          image, *command], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        deadline = time.monotonic() + 120
        while True:
            try:
                if client.is_server_ready():
                    break
            except Exception:  # noqa: BLE001  (not up yet)
                pass
            state = subprocess.run([*PODMAN, "inspect", "--format", "{{.State.Status}}", name],
                                   capture_output=True, text=True).stdout.strip()
            logs = lambda: subprocess.run([*PODMAN, "logs", name], capture_output=True, text=True).stdout[-3000:]  # noqa: E731
            assert state == "running", f"the container stopped ({state}):\n{logs()}"
            assert time.monotonic() < deadline, f"not ready in 120 s:\n{logs()}"
            time.sleep(0.5)
        health = subprocess.run([*PODMAN, "healthcheck", "run", name], capture_output=True, text=True, timeout=60)
        assert health.returncode == 0, f"HEALTHCHECK failed: {health.stdout}{health.stderr}"
        # Inside: the process runs as 10001 with no capabilities on a read-only root.
        status = subprocess.run([*PODMAN, "exec", name, "cat", "/proc/1/status"], capture_output=True, text=True,
                                timeout=60).stdout
        uid = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        assert set(uid) == {"10001"}, status
        assert next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")) == "0" * 16
        write = subprocess.run([*PODMAN, "exec", name, "touch", "/opt/x"], capture_output=True, text=True, timeout=60)
        assert write.returncode != 0 and "Read-only" in write.stderr, write.stderr
        # The key guards model control, and no process can read it from the command line.
        cmdline = subprocess.run([*PODMAN, "exec", name, "cat", "/proc/1/cmdline"], capture_output=True,
                                 timeout=60).stdout.decode(errors="replace")
        assert "recsys-admin-key=@file:" in cmdline and key not in cmdline, cmdline
        index = f"http://127.0.0.1:{http_port}/v2/repository/index"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(index, data=b"{}", method="POST"), timeout=10)
        assert refused.value.code in (401, 403), refused.value
        allowed = urllib.request.Request(index, data=b"{}", method="POST", headers={"recsys-admin-key": key})
        with urllib.request.urlopen(allowed, timeout=10) as r:
            assert any(m["name"] == "bert4rec" for m in json.loads(r.read()))

        history = np.array([[10011403, 10011207, 10011739]], dtype=np.int64)
        inp = httpclient.InferInput("ITEM_IDS", [1, 3], "INT64")
        inp.set_data_from_numpy(history)
        inside = client.infer("bert4rec", [inp])
        with TritonServer(repo, backend_dir, explicit=True, load_models=["bert4rec"],
                          log_path=tmp_path / "outside.log") as outside:
            out_inp = httpclient.InferInput("ITEM_IDS", [1, 3], "INT64")
            out_inp.set_data_from_numpy(history)
            expected = httpclient.InferenceServerClient(outside.http_url).infer("bert4rec", [out_inp])
        assert inside.as_numpy("TOP_ITEM_IDS").tolist() == expected.as_numpy("TOP_ITEM_IDS").tolist()
        assert np.allclose(inside.as_numpy("TOP_SCORES"), expected.as_numpy("TOP_SCORES"), rtol=1e-5)
        client.close()
    finally:
        subprocess.run([*PODMAN, "rm", "--force", "--time", "10", name], capture_output=True, timeout=120)
