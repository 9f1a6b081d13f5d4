"""The Grafana dashboard and the alert rules: every PromQL expression passes `promtool check
rules`, the alerts pass their `promtool test rules` cases, every `baton:` series they read is
one the services export, and every one is scoped by namespace and release; and the chart's
ServiceMonitor, PrometheusRule and dashboard ConfigMap."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

FILES = Path(__file__).resolve().parents[3] / "charts" / "baton" / "files"
METRICS_SRC = Path(__file__).resolve().parents[3] / "services" / "baton" / "common" / \
    "metrics.py"
_SUFFIX = re.compile(r"_(bucket|count|sum|total)$")


def promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        if os.environ.get("BATON_REQUIRE_PROMTOOL") == "1":
            pytest.fail("promtool is required (BATON_REQUIRE_PROMTOOL=1) but not installed")
        pytest.skip("promtool is not installed (make setup installs it as root)")
    return tool


def dashboard_exprs() -> list[str]:
    dash = json.loads((FILES / "dashboard.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((FILES / "alerts.yaml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_dashboard_expressions_pass_promtool(tmp_path):
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"baton_dashboard:expr_{i}", "expr": e.replace("$__rate_interval", "5m")}
        for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_alert_rules_check_and_unit_tests():
    tool = promtool()
    for args in (["check", "rules", "alerts.yaml"], ["test", "rules", "alerts_test.yaml"]):
        out = subprocess.run([tool, *args], cwd=FILES, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_every_series_read_is_exported():
    source = METRICS_SRC.read_text()
    exported = {_SUFFIX.sub("", n) for n in re.findall(r'"(baton:[a-z_:]+)"', source)}
    read = {_SUFFIX.sub("", n) for e in dashboard_exprs() + alert_exprs()
            for n in re.findall(r"baton:[a-z_:]+", e)}
    assert read and read <= exported, sorted(read - exported)


# -- the chart's monitoring objects (servicemonitor.yaml, prometheusrule.yaml,
# dashboard-configmap.yaml) ------------------------------------------------------------------
def test_service_monitor_scrapes_the_three_services_and_labels_the_release(renders):
    from tests.unit.deploy.kube import NAMESPACE, RELEASE, find_all, selects

    docs = renders["external-redis-values.yaml"]
    (monitor,) = find_all(docs, "ServiceMonitor")
    spec = monitor["spec"]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    (endpoint,) = spec["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("http", "/metrics",
                                                                          "30s")
    # Every series carries the release, which the alerts and the dashboard select on.
    assert endpoint["relabelings"] == [{
        "sourceLabels": ["__meta_kubernetes_service_label_app_kubernetes_io_instance"],
        "targetLabel": "baton_release"}]
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    selected = {s["metadata"]["name"] for s in find_all(docs, "Service")
                if selects(spec["selector"], s["metadata"]["labels"])}
    # Not the planner's headless router Service: each router pod is scraped once.
    assert selected == {f"{RELEASE}-{c}" for c in ("router", "prefill", "decode")}
    for svc in find_all(docs, "Service"):
        if svc["metadata"]["name"] in selected:
            assert svc["metadata"]["labels"][spec["jobLabel"]].startswith("baton-")
    assert find_all(renders["defaults"], "ServiceMonitor") == []


def test_prometheus_rule_is_the_alert_file_scoped_to_the_release(renders):
    from tests.unit.deploy.kube import NAMESPACE, RELEASE, find_all

    (rule,) = find_all(renders["external-redis-values.yaml"], "PrometheusRule")
    shipped = yaml.safe_load((FILES / "alerts.yaml").read_text())
    scope = f'namespace="{NAMESPACE}", baton_release="{RELEASE}"'
    rendered = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    original = [r for g in shipped["groups"] for r in g["rules"]]
    assert [r["alert"] for r in rendered] == [r["alert"] for r in original]
    for mine, theirs in zip(rendered, original, strict=True):
        # Every selector names this namespace and release; nothing else changes.
        assert 'baton_release!=""' not in mine["expr"]
        assert mine["expr"].count(scope) == theirs["expr"].count('baton_release!=""') >= 1
        assert mine["expr"].replace(scope, 'baton_release!=""') == theirs["expr"]
        assert {k: v for k, v in mine.items() if k != "expr"} == \
            {k: v for k, v in theirs.items() if k != "expr"}
    assert find_all(renders["defaults"], "PrometheusRule") == []


def test_ttft_slo_is_measured_at_the_router():
    rules = {r["alert"]: r for g in yaml.safe_load((FILES / "alerts.yaml").read_text())["groups"]
             for r in g["rules"]}
    assert "baton:router_time_to_first_token_seconds_bucket" in rules["BatonHighTTFT"]["expr"]
    dash = json.loads((FILES / "dashboard.json").read_text())
    (ttft,) = [p for p in dash["panels"] if p["title"].startswith("TTFT")]
    assert all("baton:router_time_to_first_token_seconds_bucket" in t["expr"]
               for t in ttft["targets"])


def test_every_alert_and_panel_is_scoped_by_namespace_and_release():
    for expr in alert_exprs():
        for series in re.findall(r"(?:baton:[a-z_:]+|\bup(?=\{))(\{[^}]*\})?", expr):
            assert 'baton_release!=""' in series, expr
    dash = json.loads((FILES / "dashboard.json").read_text())
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"namespace", "release"} <= variables
    for expr in dashboard_exprs():
        for series in re.findall(r"baton:[a-z_:]+(\{[^}]*\})?", expr):
            assert series == '{namespace=~"$namespace", baton_release=~"$release"}', expr


def test_dashboard_configmap_holds_the_dashboard(renders):
    from tests.unit.deploy.kube import RELEASE, find, names

    docs = renders["external-redis-values.yaml"]
    cm = find(docs, "ConfigMap", f"{RELEASE}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    shipped = json.loads((FILES / "dashboard.json").read_text())
    assert json.loads(cm["data"]["baton.json"]) == shipped
    assert f"{RELEASE}-dashboard" not in names(renders["defaults"], "ConfigMap")
