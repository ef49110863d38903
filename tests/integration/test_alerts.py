"""The alert rules (deploy/kubernetes/overlays/monitoring/prometheus-rules.yaml) in a real
Prometheus, over real tritonservers and a real Pushgateway fed by `recsys ... --pushgateway`, each
induced as it happens in a fleet, with the rules' waits (`for:`) shortened so the test runs in
seconds: a replica without the model (its load failed), a replica left on the version the
repository no longer names after an approve that did not reach it (two versions serving at once),
resolved by the next approve's reconcile pass, and a command that ends with a replica unreachable;
a live availability feed that stops publishing (stale) and one whose new object a server refuses."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import yaml

from conftest import contract_config, convert
from prometheus_harness import Prometheus, Pushgateway
from triton_harness import ROOT, TritonServer, free_port

RULES = ROOT / "deploy" / "kubernetes" / "overlays" / "monitoring" / "prometheus-rules.yaml"


def test_the_rule_file_is_a_prometheus_rule_that_promtool_accepts(tmp_path):
    rule = yaml.safe_load(RULES.read_text())
    assert rule["kind"] == "PrometheusRule" and rule["apiVersion"] == "monitoring.coreos.com/v1"
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    run = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "6 rules found" in run.stdout, run.stdout + run.stderr
    names = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert names == {"RecsysVersionsDiverge", "RecsysPodOffRepositoryVersion", "RecsysModelMissingOnReplicas",
                     "RecsysReleaseIncomplete", "RecsysAvailabilityStale", "RecsysAvailabilityRefused"}


def wait_until(condition, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_the_alerts_fire_on_induced_drift_and_resolve_when_reconciled(tmp_path, recsys_bin, backend_dir):
    spec = yaml.safe_load(RULES.read_text())["spec"]
    shortened = re.sub(r"for: \d+[smh]", "for: 0s", yaml.safe_dump(spec))
    rules = tmp_path / "rules.yml"
    rules.write_text(shortened)
    repo = tmp_path / "repo"
    convert(recsys_bin, "bert4rec", "bert4rec", "model.pt", tmp_path / "fp32")
    convert(recsys_bin, "bert4rec", "bert4rec", "model.safetensors", tmp_path / "int8", extra=["--precision", "int8"])

    with Pushgateway(tmp_path / "pushgateway") as gateway:
        def recsys(*args, expect=0):
            run = subprocess.run([str(recsys_bin), *args, "--repository", str(repo), "--model", "bert4rec",
                                  "--pushgateway", gateway.url], capture_output=True, text=True, timeout=300)
            assert run.returncode == expect, f"{args}: exit {run.returncode}\n{run.stdout}\n{run.stderr}"
            return run

        recsys("publish", "--approve", "--engine", str(tmp_path / "fp32"))
        # Another Triton deployment scraped by the same Prometheus: its own repository, serving
        # version 2 of a model of the same name, and the model missing on one of its servers. The
        # rules are scoped to the fleet's job: none of this may fire them.
        other_repo = tmp_path / "other-repo"
        for _ in range(2):
            subprocess.run([str(recsys_bin), "publish", "--approve", "--repository", str(other_repo), "--model",
                            "bert4rec", "--engine", str(tmp_path / "fp32")], capture_output=True, check=True,
                           timeout=300)
        with TritonServer(repo, backend_dir, explicit=True, load_models=["bert4rec"], log_path=tmp_path / "a.log") as a, \
                TritonServer(repo, backend_dir, explicit=True, load_models=["bert4rec"], log_path=tmp_path / "b.log") as b, \
                TritonServer(repo, backend_dir, explicit=True, log_path=tmp_path / "c.log") as c, \
                TritonServer(other_repo, backend_dir, explicit=True, load_models=["bert4rec"],
                             log_path=tmp_path / "d.log") as d, \
                TritonServer(other_repo, backend_dir, explicit=True, log_path=tmp_path / "e.log") as e:
            # c is live without the model, as a replica whose load failed.
            hosts = [s.metrics_url.split("/")[2] for s in (a, b, c)]
            foreign = [s.metrics_url.split("/")[2] for s in (d, e)]
            with Prometheus(tmp_path / "prometheus", {"recsys-triton": hosts, "other-triton": foreign,
                                                      "pushgateway": [gateway.url.split("/")[2]]},
                            rule_files=[rules]) as prometheus:
                missing = wait_until(lambda: prometheus.firing("RecsysModelMissingOnReplicas"),
                                     "the model missing on one replica")
                assert missing[0]["model"] == "bert4rec", missing
                wait_until(lambda: prometheus.query('nv_inference_request_success{job="other-triton",version="2"}')
                           ["data"]["result"], "the other deployment scraped")
                time.sleep(2)  # a rule evaluation after it
                assert len(prometheus.firing("RecsysModelMissingOnReplicas")) == 1
                assert not prometheus.firing("RecsysVersionsDiverge")
                assert not prometheus.firing("RecsysPodOffRepositoryVersion")

                # An approve that reaches only replica a: b stays on v1, which the repository no
                # longer names.
                recsys("publish", "--engine", str(tmp_path / "int8"))
                a_url, b_url = f"http://{a.http_url}", f"http://{b.http_url}"
                recsys("approve", "--version", "2", "--server", a_url, "--canary-on-traffic")
                # (With the waits shortened, a scrape between the approve's reload of a and its push
                # may flag a for a moment; the state the test waits for is b alone.)
                off = lambda: [(x["instance"], x["version"]) for x in prometheus.firing("RecsysPodOffRepositoryVersion")]  # noqa: E731
                wait_until(lambda: off() == [(hosts[1], "1")], f"b alone off the config (now {off()})")
                assert wait_until(lambda: prometheus.firing("RecsysVersionsDiverge"), "two versions serving")

                # The next approve with the whole fleet: its reconcile pass brings b over; both resolve.
                out = recsys("approve", "--version", "2", "--server", a_url, "--server", b_url).stdout
                assert f"{b_url} now serves bert4rec version 2" in out, out
                wait_until(lambda: not prometheus.firing("RecsysPodOffRepositoryVersion")
                           and not prometheus.firing("RecsysVersionsDiverge"), "the drift alerts resolved")
                assert not prometheus.firing("RecsysReleaseIncomplete")

                # A command that ends with a replica unreachable (exit 4) is an alert of its own.
                dead = f"http://127.0.0.1:{free_port()}"
                recsys("approve", "--version", "2", "--server", a_url, "--server", dead, expect=4)
                incomplete = wait_until(lambda: prometheus.firing("RecsysReleaseIncomplete"), "the incomplete release")
                assert incomplete[0]["command"] == "approve" and incomplete[0]["model"] == "bert4rec", incomplete
                pushed = prometheus.query('recsys_repository_version_info{model="bert4rec"}')["data"]["result"]
                assert [r["metric"]["version"] for r in pushed] == ["2"], pushed


def test_the_availability_alerts_fire_on_a_stale_feed_and_a_refused_object(tmp_path, recsys_bin, backend_dir,
                                                                           repository):
    """A feed that stops publishing: RecsysAvailabilityStale fires once the object in force is older
    than the threshold (shortened here from 30 minutes to 8 s) and resolves when a new version is
    published; a damaged object where the feed's object belongs: the server keeps the last good one
    and RecsysAvailabilityRefused fires."""
    spec = yaml.safe_dump(yaml.safe_load(RULES.read_text())["spec"])
    assert 'recsys_availability_age_seconds{job="recsys-triton"} > 1800' in spec
    shortened = re.sub(r"for: \d+[smh]", "for: 0s", spec.replace('recsys_availability_age_seconds{job="recsys-triton"} > 1800',
                                                                  'recsys_availability_age_seconds{job="recsys-triton"} > 8'))
    rules = tmp_path / "rules.yml"
    rules.write_text(shortened)
    repo = tmp_path / "repo"
    (repo / "shop").mkdir(parents=True)
    shutil.copytree(repository.parent / "engines" / "sasrec", repo / "shop" / "1")
    (repo / "shop" / "config.pbtxt").write_text(contract_config(
        "shop", params={"availability_source": "recsys-availability.bin", "availability_poll_seconds": "0.2"}))
    ids = [int(line.split("\t")[1]) for line in
           (repo / "shop" / "1" / "item_ids.tsv").read_text().splitlines()[1:40]]
    table = tmp_path / "stock.tsv"
    table.write_text("item_id\tstock\n" + "".join(f"{i}\t{'in' if i % 2 else 'out'}\n" for i in ids))

    def publish(version: int):
        run = subprocess.run([str(recsys_bin), "availability", "publish", "--repository", str(repo), "--model", "shop",
                              "--version", str(version), str(table)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr

    with TritonServer(repo, backend_dir, explicit=True, load_models=["shop"], log_path=tmp_path / "t.log") as server:
        host = server.metrics_url.split("/")[2]
        with Prometheus(tmp_path / "prometheus", {"recsys-triton": [host]}, rule_files=[rules]) as prometheus:
            publish(1)
            version = lambda: [r["value"][1] for r in prometheus.query(  # noqa: E731
                'recsys_availability_version{model="shop"}')["data"]["result"]]
            wait_until(lambda: version() == ["1"], f"version 1 scraped (now {version()})")
            assert not prometheus.firing("RecsysAvailabilityStale")
            stale = wait_until(lambda: prometheus.firing("RecsysAvailabilityStale"), "the stale feed", timeout=40)
            assert stale[0]["model"] == "shop", stale
            publish(2)
            wait_until(lambda: not prometheus.firing("RecsysAvailabilityStale"), "a fresh version resolving it")
            assert not prometheus.firing("RecsysAvailabilityRefused")
            source = repo / "shop" / "recsys-availability.bin"
            data = source.read_bytes()
            (source.with_suffix(".partial")).write_bytes(data[: len(data) // 2])
            source.with_suffix(".partial").replace(source)
            refused = wait_until(lambda: prometheus.firing("RecsysAvailabilityRefused"), "the refused object")
            assert refused[0]["model"] == "shop", refused
            assert version() == ["2"], "the last good version stays in force"
