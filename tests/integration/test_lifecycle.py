"""Model lifecycle against the real server under a bounded continuous load: publish v2, approve it
(v2 serves), reject it (v1 serves again), with zero failed requests across both switches."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import numpy as np
import tritonclient.http as httpclient

from conftest import convert
from triton_harness import ROOT, TritonServer


def test_publish_approve_reject_switch_versions_without_failed_requests(tmp_path, recsys_bin, backend_dir):
    repo = tmp_path / "repo"
    (repo / "bert4rec").mkdir(parents=True)
    shutil.copy(ROOT / "model_repository" / "bert4rec" / "config.pbtxt", repo / "bert4rec" / "config.pbtxt")
    convert(recsys_bin, "bert4rec", "bert4rec", "model.pt", tmp_path / "fp32")
    # v2: the same model at int8, so its answers (and its version number) are distinguishable.
    subprocess.run([str(recsys_bin), "convert", "--kind", "bert4rec", "--precision", "int8",
                    "--checkpoint", str(ROOT / "tests/fixtures/bert4rec/model.safetensors"),
                    "--config", str(ROOT / "tests/fixtures/bert4rec/config.json"),
                    "--item-map", str(ROOT / "tests/fixtures/bert4rec/item_id_map.tsv"),
                    "--out", str(tmp_path / "int8")], check=True, capture_output=True)

    def recsys(*args):
        return subprocess.run([str(recsys_bin), *args, "--repository", str(repo), "--model", "bert4rec"],
                              check=True, capture_output=True, text=True, timeout=180).stdout

    recsys("publish", "--approve", "--engine", str(tmp_path / "fp32"))
    with TritonServer(repo, backend_dir, explicit=True, load_models=["bert4rec"], log_path=tmp_path / "server.log") as server:
        url = f"http://{server.http_url}"
        client = httpclient.InferenceServerClient(server.http_url)
        seen, failures, stop = [], [], threading.Event()

        def load():
            items = np.array([[10011403, 10011207, 10011739]], dtype=np.int64)
            deadline = time.monotonic() + 120
            while not stop.is_set() and time.monotonic() < deadline and len(seen) < 50_000:
                inp = httpclient.InferInput("ITEM_IDS", [1, 3], "INT64")
                inp.set_data_from_numpy(items)
                try:
                    r = client.infer("bert4rec", [inp])
                    seen.append(r.get_response()["model_version"])
                except Exception as e:  # noqa: BLE001  (every failure counts)
                    failures.append(repr(e))

        worker = threading.Thread(target=load)
        worker.start()
        try:
            time.sleep(0.5)
            out = recsys("publish", "--engine", str(tmp_path / "int8"), "--server", url)
            assert "pending" in out
            time.sleep(0.3)
            assert set(seen) == {"1"}, "a pending version must not serve"
            out = recsys("approve", "--version", "2", "--server", url, "--canary-on-traffic")
            assert "now serves bert4rec version 2" in out
            mark = len(seen)
            time.sleep(0.5)
            assert "2" in seen[mark:], "v2 did not serve after approval"
            out = recsys("reject", "--version", "2", "--server", url)
            assert "now serves bert4rec version 1" in out
            mark = len(seen)
            time.sleep(0.5)
            assert set(seen[mark + 5:]) == {"1"}, "v1 did not serve again after rejecting v2"
        finally:
            stop.set()
            worker.join(30)
            # Its keep-alive connection would hold the stopping server for its exit timeout.
            client.close()
        assert failures == [], failures[:5]
        assert len(seen) > 50
        versions = recsys("versions")
        assert "rejected" in versions
