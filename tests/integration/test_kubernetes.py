"""deploy/kubernetes: every variant scripts/render-manifests.sh writes (kustomize base and overlays)
validates against the Kubernetes schemas (kubernetes-validate, strict: unknown fields are errors)
and passes checkov with no failed check (each skip carrying its reason in the manifest), as does
docker/Dockerfile; and the pieces fit together: probes on Triton's health routes, the flags that
keep a bad model from crash-looping the fleet, the headless Services selecting the Deployment's
pods, the HPA's metric defined by the prometheus-adapter rule over metrics tritonserver really
exports, the Indexed Job's --shard matching its completions, CPU requests matching the demo
configs' instance_group x threads, the image's toolchain the workspace's. No cluster exists here:
nothing is applied."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from triton_harness import ROOT

DEPLOY = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.37.0"
VARIANTS = ["server", "server-aws-keys", "server-workload-identity", "server-gpu", "batch-job", "monitoring"]
CHECKOV = ROOT / ".venv" / "checkov" / "bin" / "checkov"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rendered")
    run = subprocess.run([str(ROOT / "scripts" / "render-manifests.sh"), str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert sorted(p.stem for p in out.glob("*.yaml")) == sorted(VARIANTS)
    return out


def documents(path: Path) -> dict[tuple[str, str], dict]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(path.read_text()) if doc}


def validate(paths: list[Path]) -> subprocess.CompletedProcess:
    tool = Path(sys.executable).parent / "kubernetes-validate"
    return subprocess.run([str(tool), "--strict", "-k", KUBERNETES_VERSION, *map(str, paths)],
                          capture_output=True, text=True, timeout=120)


def checkov(path: Path, framework: str) -> dict:
    run = subprocess.run([str(CHECKOV), "-f", str(path), "--framework", framework, "--output", "json",
                          "--skip-download"],
                         capture_output=True, text=True, timeout=300, cwd=path.parent)
    assert run.stdout.strip(), run.stderr[-3000:]
    report = json.loads(run.stdout)
    report = report[0] if isinstance(report, list) else report
    # A file with nothing checkov checks (a custom resource alone) comes back as the bare summary.
    if "summary" not in report:
        report = {"summary": report, "results": {"failed_checks": [], "skipped_checks": []}}
    return report


def test_every_rendering_validates_against_the_kubernetes_schemas(rendered):
    run = validate(sorted(rendered.glob("*.yaml")))
    assert run.returncode == 0, run.stdout + run.stderr
    kinds = {kind for path in rendered.glob("*.yaml") for kind, _ in documents(path)}
    assert {"Namespace", "Deployment", "Service", "HorizontalPodAutoscaler", "Job", "ConfigMap",
            "PodDisruptionBudget", "NetworkPolicy", "ServiceAccount", "ServiceMonitor"} <= kinds
    # Everything lives in the fleet's namespace, never the default one.
    for path in rendered.glob("*.yaml"):
        for (kind, name), doc in documents(path).items():
            if kind != "Namespace":
                assert doc["metadata"].get("namespace") == "recsys", f"{path.name}: {kind}/{name}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_checkov_finds_nothing_and_every_skip_says_why(rendered, variant):
    report = checkov(rendered / f"{variant}.yaml", "kubernetes")
    summary = report["summary"]
    failed = [(c["check_id"], c["resource"]) for c in report["results"]["failed_checks"]]
    assert summary["failed"] == 0, failed
    assert variant == "monitoring" or summary["passed"] > 50, summary
    for skipped in report["results"]["skipped_checks"]:
        assert len(skipped["check_result"].get("suppress_comment", "")) > 20, skipped


def test_the_dockerfile_passes_checkov_and_builds_with_the_workspaces_toolchain():
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        report = checkov(ROOT / "docker" / dockerfile, "dockerfile")
        assert report["summary"]["failed"] == 0, (dockerfile, [c["check_id"] for c in report["results"]["failed_checks"]])
    cpu = (ROOT / "docker" / "Dockerfile.cpu").read_text()
    assert re.search(r"^USER 10001", cpu, re.M) and "HEALTHCHECK" in cpu
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    rust_version = re.search(r'^rust-version = "([0-9.]+)"', (ROOT / "Cargo.toml").read_text(), re.M).group(1)
    assert re.search(rf"ARG RUST_VERSION={re.escape(rust_version)}(\.0)?\n", dockerfile), rust_version
    assert "sha256sum -c" in dockerfile and not re.search(r"\| *(ba)?sh\b", dockerfile)
    assert re.search(r"^USER 10001", dockerfile, re.M) and "HEALTHCHECK" in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "target"} <= set(ignored)


def test_the_validator_rejects_a_broken_manifest(tmp_path):
    # The check can fail: a wrong type and (strict) a misspelt field are each reported.
    original = (DEPLOY / "base" / "serving" / "deployment.yaml").read_text()
    for name, broken, named in [
        ("type", original.replace("revisionHistoryLimit: 5", "revisionHistoryLimit: five", 1), "revisionHistoryLimit"),
        ("field", original.replace("readinessProbe:", "readinesProbe:", 1), "readinesProbe"),
    ]:
        path = tmp_path / f"broken-{name}.yaml"
        path.write_text(broken)
        run = validate([path])
        assert run.returncode != 0, name
        assert named in run.stdout + run.stderr, run.stdout + run.stderr


def test_checkov_fails_a_container_that_runs_as_root(tmp_path, rendered):
    # The scan can fail: the server without its security contexts is flagged.
    docs = list(yaml.safe_load_all((rendered / "server.yaml").read_text()))
    for doc in docs:
        if doc["kind"] == "Deployment":
            del doc["spec"]["template"]["spec"]["securityContext"]
            del doc["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    path = tmp_path / "root.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    failed = {c["check_id"] for c in checkov(path, "kubernetes")["results"]["failed_checks"]}
    assert {"CKV_K8S_20", "CKV_K8S_22", "CKV_K8S_23"} <= failed, failed


def containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"]


def test_the_pieces_fit_together(rendered):
    docs = documents(rendered / "server.yaml")
    deployment = docs[("Deployment", "recsys-triton")]
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    pod = deployment["spec"]["template"]["spec"]
    triton = containers(deployment)[0]
    args = " ".join(triton["args"])
    key_file = "/var/run/secrets/recsys-admin/key"
    for flag in ("--model-control-mode=explicit", "--model-repository=$(MODEL_REPOSITORY)",
                 "--exit-on-error=false", "--strict-readiness=true",
                 f"--http-restricted-api=model-repository,model-config,logging,trace,shared-memory:recsys-admin-key=@file:{key_file}",
                 f"--grpc-restricted-protocol=model-repository,model-config,logging,trace,shared-memory:recsys-admin-key=@file:{key_file}"):
        assert flag in triton["args"], flag
    # The key comes from its file through the preloaded library, never through a shell into argv.
    assert triton["command"] == ["tritonserver"]
    preload = {e["name"]: e.get("value") for e in triton["env"]}["LD_PRELOAD"]
    assert preload == "/opt/tritonserver/lib/librecsys_secret_args.so"
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        assert preload in (ROOT / "docker" / dockerfile).read_text(), dockerfile
    exit_timeout = int(re.search(r"--exit-timeout-secs=(\d+)", args).group(1))
    pre_stop = triton["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > exit_timeout + pre_stop
    assert triton["livenessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert triton["livenessProbe"]["periodSeconds"] * triton["livenessProbe"]["failureThreshold"] >= 600
    assert triton["startupProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert pod["automountServiceAccountToken"] is False
    assert docs[("ServiceAccount", "recsys-triton")]["automountServiceAccountToken"] is False
    mounts = {m["mountPath"] for m in triton["volumeMounts"]}
    assert {"/tmp", "/models-cache", "/var/run/secrets/recsys-admin"} <= mounts
    env = {e["name"] for e in triton["env"]}
    assert not any("SECRET" in name or "ACCESS_KEY" in name for name in env), env
    repository = docs[("ConfigMap", "recsys-fleet")]["data"]["model_repository"]
    assert re.fullmatch(r"(s3|gs)://.+", repository), repository
    pdb = docs[("PodDisruptionBudget", "recsys-triton")]["spec"]
    assert pdb["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]

    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selects = lambda selector, labels: all(labels.get(k) == v for k, v in selector.items())  # noqa: E731
    for name in ("recsys-triton", "recsys-triton-replicas", "recsys-triton-grpc"):
        selector = docs[("Service", name)]["spec"]["selector"]
        assert selects(selector, pod_labels), name

    # The canary: one pod of the same template, selected by no traffic Service, autoscaler or
    # disruption budget; its own Service; only this namespace reaches it.
    canary = docs[("Deployment", "recsys-triton-canary")]
    assert canary["spec"]["replicas"] == 1
    canary_labels = canary["spec"]["template"]["metadata"]["labels"]
    assert containers(canary)[0]["args"] == triton["args"] and containers(canary)[0]["image"] == triton["image"]
    assert canary["spec"]["template"]["spec"]["securityContext"] == pod["securityContext"]
    for name in ("recsys-triton", "recsys-triton-replicas", "recsys-triton-grpc"):
        assert not selects(docs[("Service", name)]["spec"]["selector"], canary_labels), name
    assert selects(docs[("Service", "recsys-triton-canary")]["spec"]["selector"], canary_labels)
    assert not selects(docs[("Service", "recsys-triton-canary")]["spec"]["selector"], pod_labels)
    assert not selects(pdb["selector"]["matchLabels"], canary_labels)
    assert docs[("HorizontalPodAutoscaler", "recsys-triton")]["spec"]["scaleTargetRef"]["name"] == "recsys-triton"

    # Network policies: every rule names who it admits; metrics only from scrapers' namespaces,
    # the canary only from this namespace.
    traffic_policy = docs[("NetworkPolicy", "recsys-triton")]["spec"]
    canary_policy = docs[("NetworkPolicy", "recsys-triton-canary")]["spec"]
    assert selects(traffic_policy["podSelector"]["matchLabels"], pod_labels)
    assert selects(canary_policy["podSelector"]["matchLabels"], canary_labels)
    for policy in (traffic_policy, canary_policy):
        for rule in policy["ingress"]:
            assert rule.get("from"), f"a rule admitting everyone: {rule}"
            ports = {p["port"] for p in rule["ports"]}
            sources = [f.get("namespaceSelector", {}).get("matchLabels", {}) for f in rule["from"]]
            if 8002 in ports:
                assert ports == {8002} and sources == [{"recsys.io/metrics-scraper": "true"}], rule
    assert {"recsys.io/client": "true"} in [f.get("namespaceSelector", {}).get("matchLabels")
                                            for r in traffic_policy["ingress"] for f in r["from"]]
    for rule in canary_policy["ingress"]:
        if 8000 in {p["port"] for p in rule["ports"]}:
            assert rule["from"] == [{"podSelector": {}}], rule
    headless = docs[("Service", "recsys-triton-replicas")]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    grpc = docs[("Service", "recsys-triton-grpc")]["spec"]
    assert grpc["clusterIP"] == "None" and not grpc.get("publishNotReadyAddresses")

    # CPU requested = the sum over the loaded models of instance_group count x threads.
    loaded = re.findall(r"--load-model=(\w+)", args)
    cores = 0
    for model in loaded:
        config = (ROOT / "model_repository" / model / "config.pbtxt").read_text()
        count = int(re.search(r"instance_group \[ \{ kind: KIND_CPU count: (\d+)", config).group(1))
        threads = re.search(r'key: "threads" value \{ string_value: "(\d+)"', config)
        cores += count * (int(threads.group(1)) if threads else 1)
    assert triton["resources"]["requests"]["cpu"] == str(cores)
    assert int(triton["resources"]["limits"]["cpu"]) > cores, "room for bursts above the request"

    # The variants change what they say and nothing else of the server.
    # ... for both Deployments: a canary must load a candidate as the fleet would.
    for name in ("recsys-triton", "recsys-triton-canary"):
        keys = documents(rendered / "server-aws-keys.yaml")[("Deployment", name)]
        keys_env = {e["name"]: e.get("value") for e in containers(keys)[0]["env"]}
        assert keys_env["AWS_SHARED_CREDENTIALS_FILE"] == "/var/run/secrets/aws/credentials"
        gpu = documents(rendered / "server-gpu.yaml")[("Deployment", name)]
        assert containers(gpu)[0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert gpu["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    identity = documents(rendered / "server-workload-identity.yaml")[("ServiceAccount", "recsys-triton")]
    assert "eks.amazonaws.com/role-arn" in identity["metadata"]["annotations"]
    assert not any(kind == "Job" for kind, _ in docs), "the batch Job is applied on purpose, not with the server"
    monitor = documents(rendered / "monitoring.yaml")[("ServiceMonitor", "recsys-triton")]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= docs[("Service", "recsys-triton")]["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in docs[("Service", "recsys-triton")]["spec"]["ports"]}

    hpa = docs[("HorizontalPodAutoscaler", "recsys-triton")]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == "recsys-triton"
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    adapter = yaml.safe_load(docs[("ConfigMap", "recsys-prometheus-adapter")]["data"]["config.yaml"])
    rule = next(r for r in adapter["rules"] if r["name"]["as"] == metric)
    assert "nv_inference_queue_duration_us" in rule["metricsQuery"]
    assert "nv_inference_compute_infer_duration_us" in rule["metricsQuery"]

    job = documents(rendered / "batch-job.yaml")[("Job", "recsys-predict")]
    assert job["apiVersion"] == "batch/v1" and job["spec"]["completionMode"] == "Indexed"
    command = " ".join(containers(job)[0]["args"])
    shards = re.search(r'--shard "\$\(JOB_COMPLETION_INDEX\)/(\d+)"', command)
    assert shards and int(shards.group(1)) == job["spec"]["completions"], command
    assert '--engine "$MODEL_REPOSITORY/bert4rec/$version"' in command
    assert "config_versions" in command, "the Job scores with the serving version, not a written one"


def test_the_autoscaling_metrics_are_ones_tritonserver_exports(server, http, rendered):
    # One inference so the per-model counters exist, then read the real metrics endpoint.
    import numpy as np  # noqa: PLC0415
    import tritonclient.http as httpclient  # noqa: PLC0415

    inp = httpclient.InferInput("ITEM_IDS", [1, 3], "INT64")
    inp.set_data_from_numpy(np.array([[10011403, 10011207, 10011739]], dtype=np.int64))
    http.infer("bert4rec", [inp])
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    adapter = yaml.safe_load(documents(rendered / "server.yaml")[("ConfigMap", "recsys-prometheus-adapter")]["data"]["config.yaml"])
    for rule in adapter["rules"]:
        for series in re.findall(r"\b(nv_[a-z_]+)\{", rule["metricsQuery"] + rule["seriesQuery"]):
            assert re.search(rf"^{series}\{{", text, re.M), f"tritonserver exports no {series}"


SELECTOR_KINDS = ("Deployment", "StatefulSet", "DaemonSet")


def render_at(commit: str, out: Path) -> Path:
    """Every variant of deploy/kubernetes as it was at `commit`, rendered by the same kustomize."""
    have = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    assert have.returncode == 0, (f"commit {commit} is not in this clone: the upgrade check needs the history "
                                  f"back to it (a clone without --depth)")
    tree = out / "tree"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "deploy/kubernetes"], capture_output=True,
                             check=True, timeout=60).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True, timeout=60)
    kubectl = ROOT / ".venv" / "bin" / "kubectl"
    rendered = out / "rendered"
    rendered.mkdir()
    variants = {"server": "base", "server-aws-keys": "overlays/aws-keys",
                "server-workload-identity": "overlays/workload-identity", "server-gpu": "overlays/gpu",
                "batch-job": "overlays/batch-job", "monitoring": "overlays/monitoring"}
    for name, folder in variants.items():
        source = tree / "deploy" / "kubernetes" / folder
        if source.is_dir():
            run = subprocess.run([str(kubectl), "kustomize", str(source)], capture_output=True, text=True, timeout=120)
            assert run.returncode == 0, f"{commit} {folder}: {run.stderr}"
            (rendered / f"{name}.yaml").write_text(run.stdout)
    return rendered


def released_commit() -> str:
    tags = subprocess.run(["git", "-C", str(ROOT), "tag", "--list", "v*", "--sort=-creatordate"],
                          capture_output=True, text=True, check=True).stdout.split()
    if tags:
        return tags[0]
    lines = [line.strip() for line in (DEPLOY / "RELEASED").read_text().splitlines()]
    return next(line for line in lines if line and not line.startswith("#"))


def upgrade_problems(before: Path, after: Path) -> list[str]:
    """What `kubectl apply` of `after` over an install of `before` would break: a selector of a
    workload that exists in both that changed (immutable: the apply fails), and a Service whose
    selector the running pods (`before`'s pod templates) no longer match (it would empty until
    new pods replace them)."""
    problems = []
    for path in sorted(before.glob("*.yaml")):
        if not (after / path.name).exists():
            continue
        old, new = documents(path), documents(after / path.name)
        old_pods = [doc["spec"]["template"]["metadata"].get("labels", {})
                    for (kind, _), doc in old.items() if kind in SELECTOR_KINDS]
        for key, doc in new.items():
            kind, name = key
            if kind in SELECTOR_KINDS and key in old:
                if old[key]["spec"].get("selector") != doc["spec"].get("selector"):
                    problems.append(f"{path.stem}: {kind}/{name} selector {old[key]['spec'].get('selector')} -> "
                                    f"{doc['spec'].get('selector')}")
            if kind == "Service" and key in old and doc["spec"].get("selector"):
                selector = doc["spec"]["selector"]
                if not any(all(labels.get(k) == v for k, v in selector.items()) for labels in old_pods):
                    problems.append(f"{path.stem}: Service/{name} selects {selector}, which no running pod has")
    return problems


def test_an_upgrade_from_the_released_manifests_keeps_every_selector(tmp_path, rendered):
    """`kubectl apply -k` of HEAD over an install of the last release must not fail on an
    immutable selector nor leave a Service selecting no running pod."""
    before = render_at(released_commit(), tmp_path / "released")
    assert upgrade_problems(before, rendered) == []


def test_the_upgrade_check_catches_the_selector_change_that_broke_upgrades(tmp_path, rendered):
    """The change of 7ea70c9 (the traffic Deployment's selector gained recsys.io/role: traffic)
    is what the check above refuses: rendered from the commit before it, HEAD is no upgrade."""
    before = render_at("92a5f969c6e85d373cf13d3ae185b34018f3aba6", tmp_path / "before-7ea70c9")
    problems = upgrade_problems(before, rendered)
    assert any("Deployment/recsys-triton selector" in p and "recsys.io/role" in p for p in problems), problems
    assert any("Service/recsys-triton selects" in p for p in problems), problems

