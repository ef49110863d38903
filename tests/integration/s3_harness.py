"""A real S3-compatible server on 127.0.0.1 for the tests: moto's standalone server (PyPI
moto[server]), in its own process group, always stopped. It implements the S3 REST API, the
conditional writes the registry relies on (If-None-Match: * and If-Match) included, and keeps
everything in memory, so each test starts from an empty store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from triton_harness import free_port

# Credentials the server accepts; the same variables reach recsys and tritonserver.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "recsys-test",
    "AWS_SECRET_ACCESS_KEY": "recsys-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3Server:
    def __init__(self, log_path: Path):
        self.port = free_port()
        self.log_path = Path(log_path)
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def uri(self, bucket: str, prefix: str) -> str:
        """The repository in tritonserver's syntax for a custom endpoint (plain HTTP)."""
        return f"s3://127.0.0.1:{self.port}/{bucket}/{prefix}".rstrip("/")

    def client(self):
        import boto3  # noqa: PLC0415  (only in the venv)

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def start(self, timeout: float = 30.0) -> "S3Server":
        moto = Path(sys.executable).parent / "moto_server"
        self.log_file = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(self.port)],
                                        stdout=self.log_file, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.process.returncode}: {self.log_path.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2):
                    return self
            except Exception:  # noqa: BLE001  (not up yet)
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"moto_server not up after {timeout} s")

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.process = None
        self.log_file.close()

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
