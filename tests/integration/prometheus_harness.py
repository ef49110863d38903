"""A real Prometheus (Debian's `prometheus`) and Pushgateway (`prometheus-pushgateway`) on
127.0.0.1 for the tests, each in its own working folder, always stopped. scripts/python-env.sh
installs both (as root)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from triton_harness import free_port


class _Process:
    """A server binary started with `args`, ready once `ready_path` answers 200."""

    def __init__(self, binary: str, work: Path, ready_path: str):
        found = shutil.which(binary)
        assert found, f"{binary} is not installed: scripts/python-env.sh installs it from Debian (as root)"
        self.binary, self.work, self.ready_path = found, Path(work), ready_path
        self.work.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def args(self) -> list[str]:
        raise NotImplementedError

    def __enter__(self):
        self.log = open(self.work / "server.log", "w")  # noqa: SIM115 (closed in __exit__)
        self.process = subprocess.Popen([self.binary, *self.args()], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}{self.ready_path}", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            assert self.process.poll() is None, (self.work / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, f"{self.binary} did not become ready in 60 s"
            time.sleep(0.2)

    def __exit__(self, *exc):
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.log.close()


class Pushgateway(_Process):
    def __init__(self, work: Path):
        super().__init__("prometheus-pushgateway", work, "/-/ready")

    def args(self) -> list[str]:
        return [f"--web.listen-address=127.0.0.1:{self.port}"]


class Prometheus(_Process):
    """Scrapes `targets` (job name -> host:port list; a job named pushgateway keeps the pushed
    labels) every `interval_s`, evaluating `rule_files` as often."""

    def __init__(self, work: Path, targets: dict[str, list[str]], rule_files: list[Path] = (), interval_s: int = 1):
        super().__init__("prometheus", work, "/-/ready")
        jobs = "".join(
            f"  - job_name: {job}\n" + ("    honor_labels: true\n" if job == "pushgateway" else "")
            + f"    static_configs:\n      - targets: {json.dumps(hosts)}\n"
            for job, hosts in targets.items())
        rules = "".join(f"  - {path}\n" for path in rule_files)
        (self.work / "prometheus.yml").write_text(
            f"global:\n  scrape_interval: {interval_s}s\n  evaluation_interval: {interval_s}s\n"
            + (f"rule_files:\n{rules}" if rules else "") + f"scrape_configs:\n{jobs}")

    def args(self) -> list[str]:
        return [f"--config.file={self.work / 'prometheus.yml'}", f"--storage.tsdb.path={self.work / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}"]

    def query(self, expr: str) -> dict:
        body = urllib.parse.urlencode({"query": expr}).encode()
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query", data=body, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # a query Prometheus cannot parse: 400 with the reason
            return json.loads(e.read())

    def alerts(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/api/v1/alerts", timeout=10) as r:
            return json.loads(r.read())["data"]["alerts"]

    def firing(self, name: str) -> list[dict]:
        """The labels of every firing alert named `name`."""
        return [a["labels"] for a in self.alerts() if a["labels"]["alertname"] == name and a["state"] == "firing"]
