"""The Grafana dashboard and the alert rules: every PromQL expression passes `promtool check
rules`, the alerts pass their `promtool test rules` cases, and every `baton:` series they
read is one the services export."""

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
