"""deploy/kubernetes: every manifest validates against the Kubernetes schemas (kubernetes-validate,
strict: unknown fields are errors), and the pieces fit together: probes on Triton's health routes,
the headless Service selecting the Deployment's pods, the HPA's metric defined by the
prometheus-adapter rule over metrics tritonserver really exports, the Indexed Job's --shard
matching its completions, CPU requests matching the demo configs' instance_group x threads. No
cluster exists here: nothing is applied."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import yaml

from triton_harness import ROOT

DEPLOY = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.37.0"


def manifests() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def validate(paths: list[Path]) -> subprocess.CompletedProcess:
    tool = Path(sys.executable).parent / "kubernetes-validate"
    return subprocess.run([str(tool), "--strict", "-k", KUBERNETES_VERSION, *map(str, paths)],
                          capture_output=True, text=True, timeout=120)


def test_every_manifest_validates_against_the_kubernetes_schemas():
    paths = sorted(DEPLOY.glob("*.yaml"))
    assert len(paths) >= 5
    run = validate(paths)
    assert run.returncode == 0, run.stdout + run.stderr
    kinds = {kind for kind, _ in manifests()}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "Job", "ConfigMap"} <= kinds


def test_the_validator_rejects_a_broken_manifest(tmp_path):
    # The check can fail: a wrong type and (strict) a misspelt field are each reported.
    original = (DEPLOY / "deployment.yaml").read_text()
    for name, broken, named in [
        ("type", original.replace("replicas: 2", "replicas: two", 1), "replicas"),
        ("field", original.replace("readinessProbe:", "readinesProbe:", 1), "readinesProbe"),
    ]:
        path = tmp_path / f"broken-{name}.yaml"
        path.write_text(broken)
        run = validate([path])
        assert run.returncode != 0, name
        assert named in run.stdout + run.stderr, run.stdout + run.stderr


def containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"]


def test_the_pieces_fit_together():
    docs = manifests()
    deployment = docs[("Deployment", "recsys-triton")]
    triton = containers(deployment)[0]
    args = " ".join(triton["args"])
    assert "--model-control-mode=explicit" in args and "--model-repository=$(MODEL_REPOSITORY)" in args
    assert triton["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    repository = docs[("ConfigMap", "recsys-fleet")]["data"]["model_repository"]
    assert re.fullmatch(r"(s3|gs)://.+", repository), repository

    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for name in ("recsys-triton", "recsys-triton-replicas"):
        selector = docs[("Service", name)]["spec"]["selector"]
        assert all(pod_labels.get(k) == v for k, v in selector.items()), name
    headless = docs[("Service", "recsys-triton-replicas")]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True

    # CPU requested = the sum over the loaded models of instance_group count x threads.
    loaded = re.findall(r"--load-model=(\w+)", args)
    cores = 0
    for model in loaded:
        config = (ROOT / "model_repository" / model / "config.pbtxt").read_text()
        count = int(re.search(r"instance_group \[ \{ kind: KIND_CPU count: (\d+)", config).group(1))
        threads = re.search(r'key: "threads" value \{ string_value: "(\d+)"', config)
        cores += count * (int(threads.group(1)) if threads else 1)
    assert triton["resources"]["requests"]["cpu"] == str(cores)
    assert triton["resources"]["limits"]["cpu"] == str(cores)

    hpa = docs[("HorizontalPodAutoscaler", "recsys-triton")]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == "recsys-triton"
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    adapter = yaml.safe_load(docs[("ConfigMap", "recsys-prometheus-adapter")]["data"]["config.yaml"])
    rule = next(r for r in adapter["rules"] if r["name"]["as"] == metric)
    assert "nv_inference_queue_duration_us" in rule["metricsQuery"]
    assert "nv_inference_compute_infer_duration_us" in rule["metricsQuery"]

    job = docs[("Job", "recsys-predict")]
    assert job["apiVersion"] == "batch/v1" and job["spec"]["completionMode"] == "Indexed"
    command = " ".join(containers(job)[0]["args"])
    shards = re.search(r'--shard "\$\(JOB_COMPLETION_INDEX\)/(\d+)"', command)
    assert shards and int(shards.group(1)) == job["spec"]["completions"], command
    assert "--engine \"$(MODEL_REPOSITORY)/" in command


def test_the_autoscaling_metrics_are_ones_tritonserver_exports(server, http):
    # One inference so the per-model counters exist, then read the real metrics endpoint.
    import numpy as np  # noqa: PLC0415
    import tritonclient.http as httpclient  # noqa: PLC0415

    inp = httpclient.InferInput("ITEM_IDS", [1, 3], "INT64")
    inp.set_data_from_numpy(np.array([[10011403, 10011207, 10011739]], dtype=np.int64))
    http.infer("bert4rec", [inp])
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    adapter = yaml.safe_load(manifests()[("ConfigMap", "recsys-prometheus-adapter")]["data"]["config.yaml"])
    for rule in adapter["rules"]:
        for series in re.findall(r"\b(nv_[a-z_]+)\{", rule["metricsQuery"] + rule["seriesQuery"]):
            assert re.search(rf"^{series}\{{", text, re.M), f"tritonserver exports no {series}"

