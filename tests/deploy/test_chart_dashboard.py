"""The Grafana dashboard the chart ships: fresh from ``deploy/helm/dashboard.py``, valid JSON of
Grafana's model, and shipped as a ConfigMap that Grafana's sidecar picks up by label. (That
every metric it queries is exported and moves under load: tests/services/
test_dashboard_metrics.py.)"""

from __future__ import annotations

import json
import re

from tests.deploy.test_chart import CHART, load_chart_script, objects

DASHBOARD_MODULE = load_chart_script("dashboard")
SHIPPED = CHART / "dashboards" / "splitserve.json"


def test_the_shipped_dashboard_is_fresh_and_well_formed():
    assert SHIPPED.read_text() == DASHBOARD_MODULE.render(), (
        "dashboards/splitserve.json is stale: run python deploy/helm/dashboard.py"
    )
    dashboard = json.loads(SHIPPED.read_text())
    assert dashboard["uid"] == "splitserve" and dashboard["schemaVersion"] >= 36
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
            used = {name for name in re.findall(r"\$(\w+)", expr) if not name.startswith("__")}
            assert used <= variables, expr
            assert target["datasource"]["uid"] == "${datasource}"
    titles = {p["title"] for p in dashboard["panels"]}
    for topic in ("Time to first token", "Inter-token latency", "KV cache usage"):
        assert topic in titles


def test_the_chart_ships_it_as_a_configmap_for_grafanas_sidecar():
    (configmap,) = [o for o in objects({}) if o["kind"] == "ConfigMap" and "dashboard" in str(o)]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["splitserve.json"]) == json.loads(SHIPPED.read_text())
    folder = {"grafana_folder": "LLM serving"}
    values = {"metrics": {"grafanaDashboard": {"labels": {"team": "ml"}, "annotations": folder}}}
    (custom,) = [o for o in objects(values) if o["kind"] == "ConfigMap" and "dashboard" in str(o)]
    assert custom["metadata"]["labels"]["team"] == "ml"
    assert custom["metadata"]["annotations"] == folder
    off = {"metrics": {"grafanaDashboard": {"enabled": False}}}
    assert not [o for o in objects(off) if o["kind"] == "ConfigMap" and "dashboard" in str(o)]
