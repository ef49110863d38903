"""Starting and stopping a real tritonserver (from the nvidia-pytriton wheel) for the tests, the demo
and the benchmarks. Everything binds 127.0.0.1; every wait is bounded; stop() always leaves nothing
running (the server runs in its own process group, which is killed)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tritonserver_binary() -> Path:
    """The tritonserver shipped inside the nvidia-pytriton wheel of the project's venv."""
    import pytriton  # noqa: PLC0415  (only importable inside the venv)

    binary = Path(pytriton.__file__).parent / "tritonserver" / "bin" / "tritonserver"
    if not binary.exists():
        raise FileNotFoundError(f"tritonserver not found at {binary}; run scripts/python-env.sh")
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    """One tritonserver process. Use as a context manager, or call start() and stop()."""

    def __init__(
        self,
        repository: Path | str,
        backend_dir: Path,
        *,
        explicit: bool = False,
        load_models: list[str] | None = None,
        log_path: Path | None = None,
        extra_args: list[str] | None = None,
    ):
        # A local folder, or an object-store URI (s3://..., gs://...) passed to the server as is.
        self.repository = repository if "://" in str(repository) else Path(repository)
        self.backend_dir = Path(backend_dir)
        self.explicit = explicit
        self.load_models = load_models or []
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        if log_path is None and not isinstance(self.repository, Path):
            raise ValueError("a server on an object-store repository needs log_path")
        self.log_path = Path(log_path) if log_path else self.repository.parent / "tritonserver.log"
        self.extra_args = extra_args or []
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        cmd = [
            str(tritonserver_binary()),
            f"--model-repository={self.repository}",
            f"--backend-directory={self.backend_dir}",
            "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1",
            "--metrics-address=127.0.0.1",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            # No GPU here: no pinned host pool, no GPU metrics (design.md section 4).
            "--pinned-memory-pool-byte-size=0",
            "--allow-gpu-metrics=false",
        ]
        if self.explicit:
            cmd.append("--model-control-mode=explicit")
            cmd += [f"--load-model={m}" for m in self.load_models]
        return cmd + self.extra_args

    def start(self, timeout: float = 60.0, *, until: str = "ready") -> "TritonServer":
        """Starts the server and waits until it is ready (`until="live"`: only live, for a server
        expected to stay up without a loadable model)."""
        self.log_file = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            self.command(),
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with {self.process.returncode}; log:\n{self.log()}"
                )
            # Triton answers ready on HTTP before its metrics endpoint listens: wait for both, so
            # a caller that reads the metrics right away finds them.
            if self._get(f"/v2/health/{until}") == 200 and (not self.metrics_enabled() or self._metrics_up()):
                return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"tritonserver not ready after {timeout} s; log:\n{self.log()}")

    def _get(self, path: str) -> int | None:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=2) as r:
                return r.status
        except Exception:  # noqa: BLE001  (not up yet, or not ready)
            return None

    def metrics_enabled(self) -> bool:
        return "--allow-metrics=false" not in self.extra_args

    def _metrics_up(self) -> bool:
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as r:
                return r.status == 200
        except Exception:  # noqa: BLE001  (not listening yet)
            return False

    def is_ready(self) -> bool:
        return self._get("/v2/health/ready") == 200

    def is_live(self) -> bool:
        return self._get("/v2/health/live") == 200

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.process = None
        self.log_file.close()

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
