"""KIND_GPU instances through the CUDA build of the backend (scripts/build-release.sh --cuda, as the
Docker image builds it). Where no GPU driver exists (CI, these machines) Triton itself refuses the
instance group before the backend is asked (the backend's own messages for a missing driver, NVRTC or
device are tested in gpu/tests/gpu_kernels.rs), and the server keeps serving its CPU models, from the
same CUDA build; where a GPU exists, the GPU model must answer like the CPU model (scripts/gpu-check.sh
covers the kernels themselves)."""

from __future__ import annotations

import ctypes.util
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import contract_config, convert
from triton_harness import ROOT, TritonServer

CUDA_BACKEND = Path(os.environ.get("RECSYS_CUDA_BACKEND_DIR", ROOT / "build" / "test-backends-cuda"))


def infer(client, model, history):
    t = httpclient.InferInput("ITEM_IDS", [1, len(history)], "INT64")
    t.set_data_from_numpy(np.array([history], dtype=np.int64))
    r = client.infer(model, [t])
    return r.as_numpy("TOP_ITEM_IDS")[0].tolist(), r.as_numpy("TOP_SCORES")[0]


def test_kind_gpu_loads_on_a_gpu_or_fails_clearly_without_one(tmp_path, recsys_bin):
    if not (CUDA_BACKEND / "recsys" / "libtriton_recsys.so").exists():
        pytest.fail(f"{CUDA_BACKEND} has no CUDA build of the backend: run scripts/test.sh (it builds one)")
    engine = tmp_path / "engine"
    convert(recsys_bin, "vaecf", "multivae", "model.safetensors", engine)
    repo = tmp_path / "repo"
    for name, kind in [("cpu", "KIND_CPU"), ("gpu", "KIND_GPU")]:
        shutil.copytree(engine, repo / name / "1")
        (repo / name / "config.pbtxt").write_text(contract_config(name, kind=kind))
    has_driver = ctypes.util.find_library("cuda") is not None
    # The client closes before the server stops: an open keep-alive connection would hold the
    # stopping server for its exit timeout.
    with TritonServer(repo, CUDA_BACKEND, explicit=True, load_models=["cpu"], log_path=tmp_path / "server.log") as server, \
            httpclient.InferenceServerClient(server.http_url) as client:
        cpu_ids, cpu_scores = infer(client, "cpu", [10011403, 10011207])
        if has_driver:
            client.load_model("gpu")
            gpu_ids, gpu_scores = infer(client, "gpu", [10011403, 10011207])
            assert gpu_ids == cpu_ids
            assert np.abs(gpu_scores - cpu_scores).max() < 1e-4
        else:
            with pytest.raises(InferenceServerException) as err:
                client.load_model("gpu")
            message = str(err.value)
            assert "has kind KIND_GPU but no GPUs are available" in message, message
            assert not client.is_model_ready("gpu")
        assert server.is_live()
        assert infer(client, "cpu", [10011403, 10011207])[0] == cpu_ids
