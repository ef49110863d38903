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


def answer_s3_error(handler, status: int, code: str, message: str = "injected") -> None:
    """Answers the request `handler` (a BaseHTTPRequestHandler) as S3 answers a failure."""
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error>").encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/xml")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def forward(handler, target_port: int, body: bytes | None) -> int:
    """Sends the request `handler` holds to the S3 server on `target_port` and its answer back;
    returns the answer's status."""
    import http.client  # noqa: PLC0415

    upstream = http.client.HTTPConnection("127.0.0.1", target_port, timeout=120)
    headers = {k: v for k, v in handler.headers.items() if k.lower() != "host"}
    headers["Host"] = f"127.0.0.1:{target_port}"
    try:
        upstream.request(handler.command, handler.path, body=body, headers=headers)
        response = upstream.getresponse()
        data = response.read()
        handler.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)
        return response.status
    finally:
        upstream.close()


class FaultyProxy:
    """An HTTP proxy in front of the S3 server that forwards every request until a request matching
    `trigger` (method, path) has been forwarded, then answers every later one with 403
    ExpiredToken, as S3 does once a session token expires in the middle of a command. With
    `slow_once` (method, path) -> seconds, the first request for each such path waits that long
    before it is forwarded (a slow link to the store, as a large engine's download is). Binds
    127.0.0.1; stopped by the context manager."""

    def __init__(self, target_port: int, trigger=None, slow_once=None):
        import http.server  # noqa: PLC0415
        import socketserver  # noqa: PLC0415
        import threading  # noqa: PLC0415

        self.port = free_port()
        self.failing = threading.Event()
        self.forwarded: list[tuple[str, str]] = []
        self.slowed: set[str] = set()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _any(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if proxy.failing.is_set():
                    answer_s3_error(self, 403, "ExpiredToken", "The provided token has expired.")
                    return
                if slow_once is not None and self.path not in proxy.slowed:
                    wait = slow_once(self.command, self.path)
                    if wait:
                        proxy.slowed.add(self.path)
                        time.sleep(wait)
                status = forward(self, target_port, body)
                proxy.forwarded.append((self.command, self.path))
                if trigger is not None and trigger(self.command, self.path) and status < 300:
                    proxy.failing.set()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def uri(self, bucket: str, prefix: str) -> str:
        return f"s3://127.0.0.1:{self.port}/{bucket}/{prefix}".rstrip("/")

    def __enter__(self) -> "FaultyProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
