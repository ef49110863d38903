"""The README's examples run as a reader would run them: its command-line block (convert,
predict, eval) and its Python block, in a fresh folder with the repository's fixtures and the built
`recsys`. The `curl` block is the request `scripts/serve.sh --check` sends to the demo server (a
stage of scripts/test.sh)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def blocks(section: str) -> list[tuple[str, str]]:
    """The fenced blocks (language, text) of the README section headed `section`."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start:end if end > 0 else len(text)]
    return re.findall(r"```(\w+)\n(.*?)```", body, flags=re.S)


def test_the_readme_examples_run_as_written(recsys_bin, tmp_path):
    found = blocks("One example per interface")
    assert [lang for lang, _ in found] == ["sh", "sh", "python"], found
    curl, commands, python = (text for _, text in found)
    serve = (ROOT / "scripts" / "serve.sh").read_text()
    assert "10011403, 10011207, 10011739" in curl and "10011403, 10011207, 10011739" in serve
    # The folder a reader runs them in: the fixtures and the built binary where the block says.
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "fixtures").symlink_to(ROOT / "tests" / "fixtures")
    (tmp_path / "target" / "release").mkdir(parents=True)
    (tmp_path / "target" / "release" / "recsys").symlink_to(recsys_bin)
    lines = commands.replace("\\\n", " ").splitlines()
    assert lines[0].startswith("cargo build --release -p recsys-cli"), lines[0]
    script = "set -euo pipefail\n" + "\n".join(lines[1:]) + "\n"  # the build is the test run's own
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    outputs = run.stdout.strip().splitlines()
    assert outputs[0].startswith("wrote bert4rec engine to engines/bert4rec-int8"), outputs[0]
    answer = json.loads(outputs[1])
    assert answer["user_id"] == 7 and len(answer["item_ids"]) == 5, answer
    metrics = json.loads("\n".join(outputs[2:]))["metrics"]
    assert metrics["n_users"] == 5000 and 0.1 < metrics["ndcg@10"] < 0.2, metrics
    # The Python block, against the engine the commands wrote.
    check = python + "\nassert ids.shape == (2, 10) and scores.shape == (2, 10), (ids.shape, scores.shape)\n" \
        "assert users.shape[0] == 1\n"
    run = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**os.environ})
    assert run.returncode == 0, run.stderr
