"""deploy/prometheus: the scrape config and the alert rules are valid (`promtool check config`, `promtool check
rules`), and the alerts fire when they should and only then (`promtool test rules alerts.test.yml`: input series,
expected alerts). promtool is Debian's `prometheus` package: `make tools` installs it, and without it these
fail, saying so."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.conftest import installed

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")


def promtool(*args: str) -> str:
    done = subprocess.run([PROMTOOL or installed("promtool", "prometheus"), *args], cwd=PROMETHEUS,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_the_scrape_config_and_its_rules_are_valid():
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml")
    assert "SUCCESS" in promtool("check", "rules", "alerts.yml")


def test_the_alerts_fire_on_their_input_series():
    assert "SUCCESS" in promtool("test", "rules", "alerts.test.yml")


def test_every_alert_is_unit_tested_and_documented():
    """An alert added to alerts.yml without a test of it in alerts.test.yml, or a word in
    docs/observability.md, fails here (without promtool too)."""
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    tests = yaml.safe_load((PROMETHEUS / "alerts.test.yml").read_text())
    tested = {case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert alerts == tested, f"alerts without a firing test: {alerts - tested}"
    doc = (PROMETHEUS.parents[1] / "docs" / "observability.md").read_text()
    assert not [a for a in alerts if f"`{a}`" not in doc], "docs/observability.md misses an alert"
