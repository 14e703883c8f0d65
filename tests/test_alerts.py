"""The PrometheusRule's alerts under Prometheus' own rule test tool (issue #41, item 2): every alert of
k8s/base/monitoring/prometheusrule.yaml fires on the synthetic series of k8s/base/monitoring/rule-tests/ and
stays quiet on their controls (`promtool test rules`). Skips only without promtool (the Debian package
prometheus; `make system-deps` installs it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

MONITORING = Path(__file__).resolve().parents[1] / "k8s" / "base" / "monitoring"
RULE_TESTS = sorted((MONITORING / "rule-tests").glob("*.test.yaml"))


def _rule() -> dict:
    return yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())


def test_every_alert_has_a_firing_rule_test():
    alerts = [r["alert"] for g in _rule()["spec"]["groups"] for r in g["rules"]]
    assert len(alerts) == len(set(alerts)), "alert names must be unique"
    fired = set()
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == ["rules.yaml"], path       # the groups written out by the test below
        for case in doc["tests"]:
            fired |= {t["alertname"] for t in case["alert_rule_test"] if t.get("exp_alerts")}
    assert set(alerts) <= fired, f"alerts without a firing case: {sorted(set(alerts) - fired)}"
    assert fired <= set(alerts), f"rule tests of unknown alerts: {sorted(fired - set(alerts))}"


def test_alert_rules_pass_promtool_rule_tests(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": _rule()["spec"]["groups"]}))
    for path in RULE_TESTS:
        shutil.copy(path, tmp_path / path.name)
    proc = subprocess.run([promtool, "test", "rules", *(p.name for p in RULE_TESTS)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
