"""The Grafana dashboard (deploy/grafana/recsys.json) against real data: a real Prometheus (Debian's
`prometheus`, installed by scripts/python-env.sh) scrapes the session's real tritonserver while
requests of every kind arrive, and every query of every panel, with Grafana's variables filled in
as Grafana fills them, must parse in Prometheus and return series. A renamed metric, a typo in a
query or a label the server does not export fails here, not on an operator's empty panel."""

from __future__ import annotations

import json
import time
import urllib.parse
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from conftest import golden_cases
from test_serving import make_inputs
from prometheus_harness import Prometheus

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "recsys.json"
SCRAPE_S = 1
# Grafana's $__rate_interval is at least four scrape intervals; the same here.
RATE_INTERVAL = f"{4 * SCRAPE_S}s"


def panels(dashboard: dict) -> list[dict]:
    """Every panel with queries, rows' own panels included."""
    out = []
    for p in dashboard["panels"]:
        out.extend(p.get("panels", []))
        if p.get("targets"):
            out.append(p)
    return out


def grafana_expr(expr: str) -> str:
    """A panel query as Grafana sends it with the model variable at All (its allValue .*)."""
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$model", ".*")


def test_the_dashboard_is_valid_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert names == {"datasource", "model"}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels(dashboard):
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["description"], p["title"]
        for t in p["targets"]:
            assert 'model=~"$model"' in t["expr"], (p["title"], t["expr"])


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    """Prometheus on 127.0.0.1 scraping the session server's metrics every second; stopped after."""
    target = urllib.parse.urlparse(server.metrics_url).netloc
    with Prometheus(tmp_path_factory.mktemp("prometheus"), {"recsys-triton": [target]}, interval_s=SCRAPE_S) as running:
        yield running


def query(prometheus: Prometheus, expr: str) -> dict:
    return prometheus.query(expr)


def traffic(http, rounds: int) -> None:
    """Requests of every kind the panels count: plain, unknown ids, over-long, refused, screened."""
    case = golden_cases("multivae")[0]["history_ext"]
    for _ in range(rounds):
        http.infer("bert4rec", make_inputs(httpclient, [10011403, 5, 6]))
        http.infer("bert4rec", make_inputs(httpclient, list(range(10011403, 10011403 + 7 * 60, 7))))
        http.infer("vaecf_screened", make_inputs(httpclient, case, k=20))
        http.infer("vaecf", make_inputs(httpclient, case, k=20))
        try:
            http.infer("bert4rec", make_inputs(httpclient, [10011403], k=-3))
        except Exception:  # noqa: BLE001 - the refusal is the point: it feeds the refusals panel
            pass


def test_every_panel_query_parses_and_returns_series_from_a_real_server(server, http, prometheus):
    dashboard = json.loads(DASHBOARD.read_text())
    # Requests spread over several scrapes, so each rate() window holds at least two samples.
    deadline = time.monotonic() + 8 * SCRAPE_S
    while time.monotonic() < deadline:
        traffic(http, 3)
        time.sleep(0.25)
    # The model variable's own query.
    models = query(prometheus, "count by (model) (nv_inference_count)")
    assert models["status"] == "success", models
    served = {r["metric"]["model"] for r in models["data"]["result"]}
    assert {"bert4rec", "vaecf", "vaecf_screened"} <= served, served
    empty, failed = [], []
    for p in panels(dashboard):
        for t in p["targets"]:
            expr = grafana_expr(t["expr"])
            answer = query(prometheus, expr)
            if answer.get("status") != "success":
                failed.append((p["title"], expr, answer.get("error")))
            elif not [r for r in answer["data"]["result"] if r["value"][1] not in ("NaN",)]:
                empty.append((p["title"], expr))
    assert not failed, f"queries Prometheus refused: {failed}"
    assert not empty, f"queries with no data from a served model: {empty}"
