"""The soak and fault test, short: scripts/soak.py for RECSYS_SOAK_SECONDS (default 40) against the
real tritonserver: both models at saturation with invalid requests mixed in, reloads, a version switch
and rollback, a corrupted version dropped in; zero unexpected errors, the server alive, memory flat
after warm-up. `scripts/soak.sh --seconds 600` is the full run (docs/BENCHMARKS.md records it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from triton_harness import ROOT


def test_short_soak_has_no_unexpected_errors_and_flat_memory(tmp_path, backend_dir):
    seconds = float(os.environ.get("RECSYS_SOAK_SECONDS", "40"))
    out = tmp_path / "soak"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "soak.py"), "--seconds", str(seconds), "--concurrency", "2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=seconds + 300,
        env={**os.environ, "RECSYS_BACKEND_DIR": str(backend_dir)},
    )
    summary_path = out / "summary.json"
    # A crash before the summary is written says why in the script's own output, not as a missing file.
    assert summary_path.exists(), f"soak.py exited {run.returncode} without a summary:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    summary = json.loads(summary_path.read_text())
    print(json.dumps({k: summary.get(k) for k in ["requests_succeeded", "requests_failed", "mixed_invalid_sent",
                                                  "rss_mib", "events", "problems"]}, indent=1))
    assert run.returncode == 0 and summary["ok"], summary["problems"] or run.stdout[-3000:] + run.stderr[-3000:]
    assert all(n > 100 for n in summary["requests_succeeded"].values())
    assert summary["mixed_invalid_sent"] > 10
    assert any("still serving bert4rec_versions v2" in e for e in summary["events"])
    assert summary["versioned_model_failures"] == 0 and summary["versions_seen"] == ["1", "2"]
