"""The CPU a benchmark ran on, as `lscpu` names it: every table names it (the project's machine is
sometimes AMD, sometimes Intel)."""

from __future__ import annotations

import platform
import subprocess


def cpu_model() -> str:
    """`lscpu`'s model name, else what Python's platform module knows, else "unknown"."""
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"
