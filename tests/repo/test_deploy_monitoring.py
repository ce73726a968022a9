"""The Prometheus and Grafana files agree with the code: the alerts and the
dashboard query metrics the processes define, every alert says what to do
and has promtool unit tests, Prometheus scrapes every process."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.repo.deploy_files import (
    ALERT_TESTS,
    ALERTS,
    METRIC,
    PROMETHEUS,
    ROOT,
    alert_rules,
    code_metric_names,
    compose,
    dashboard,
    dashboard_exprs,
    dashboard_panels,
)


def test_metric_helper_sees_counter_histogram_and_gauge_names() -> None:
    """The names collected from the registry include each metric type's exposed suffixes."""
    names = code_metric_names()
    assert {
        "storyjobs_jobs_rejected_total",
        "storyjobs_http_request_duration_seconds_bucket",
        "storyjobs_job_run_seconds_count",
        "storyjobs_worker_busy",
        "storyjobs_oldest_pending_age_seconds",
    } <= names
    # a counter is exposed with _total only: its bare name is no metric
    assert "storyjobs_jobs_rejected" not in names


def test_alert_rules_use_only_metrics_defined_in_code() -> None:
    """Every storyjobs_ metric named in an alert expression or annotation exists in the code."""
    used: set[str] = set()
    for rule in alert_rules():
        used |= set(METRIC.findall(rule["expr"]))
        for text in rule["annotations"].values():
            used |= set(METRIC.findall(text))
    assert len(used) >= 8
    assert used - code_metric_names() == set()


def test_dashboard_uses_only_metrics_defined_in_code() -> None:
    """Every storyjobs_ metric queried by a dashboard panel exists in the code."""
    used = {name for expr in dashboard_exprs() for name in METRIC.findall(expr)}
    assert len(used) >= 10
    assert used - code_metric_names() == set()


def test_alerts_cover_queue_failures_races_claims_sweeper_api_rejections_and_spend() -> None:
    """The alert expressions watch each operational signal the services export."""
    exprs = "\n".join(rule["expr"] for rule in alert_rules())
    for needed in (
        "storyjobs_oldest_pending_age_seconds",
        'storyjobs_job_transitions_total{to="failed"}',
        "storyjobs_lost_races_total",
        'storyjobs_jobs{status="pending"}',
        'storyjobs_job_transitions_total{to="running"}',
        "storyjobs_sweeper_last_run_timestamp_seconds",
        "storyjobs_http_requests_total",
        'storyjobs_jobs_rejected_total{reason="queue_full"}',
        "storyjobs_llm_cost_usd_total",
    ):
        assert needed in exprs, needed


def test_every_alert_has_a_summary_and_a_description_of_what_to_do() -> None:
    """Each alert rule carries a severity, a summary and a non-trivial description."""
    rules = alert_rules()
    assert len({rule["alert"] for rule in rules}) == len(rules)
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert len(rule["annotations"]["description"].split()) >= 15, rule["alert"]


def test_dashboard_is_grafana_json_with_a_prometheus_datasource_variable() -> None:
    """The dashboard declares a Prometheus datasource variable that every panel and query uses."""
    board = dashboard()
    assert board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    data_panels = [p for p in dashboard_panels() if p["type"] != "row"]
    assert data_panels
    for panel in data_panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    ids = [p["id"] for p in dashboard_panels()]
    assert len(ids) == len(set(ids))


def test_dashboard_quantiles_read_histogram_buckets() -> None:
    """Every histogram_quantile in the dashboard runs over a _bucket series."""
    quantiles = [expr for expr in dashboard_exprs() if "histogram_quantile" in expr]
    assert quantiles
    for expr in quantiles:
        assert re.search(r"storyjobs_[a-z_]+_bucket\b", expr), expr
    joined = "\n".join(quantiles)
    for histogram in ("storyjobs_job_queue_wait_seconds", "storyjobs_job_run_seconds",
                      "storyjobs_http_request_duration_seconds"):
        assert histogram + "_bucket" in joined


def test_dashboard_shows_queue_workers_llm_sweeper_and_api() -> None:
    """The dashboard has panels for each area an operator watches."""
    used = {name for expr in dashboard_exprs() for name in METRIC.findall(expr)}
    assert {
        "storyjobs_jobs",
        "storyjobs_oldest_pending_age_seconds",
        "storyjobs_job_transitions_total",
        "storyjobs_llm_requests_total",
        "storyjobs_llm_tokens_total",
        "storyjobs_llm_cost_usd_total",
        "storyjobs_lost_races_total",
        "storyjobs_sweeper_reclaimed_total",
        "storyjobs_http_requests_total",
        "storyjobs_worker_busy",
        "storyjobs_worker_slots",
    } <= used


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *map(str, args)], capture_output=True, text=True, check=False, cwd=ROOT)


def alert_rule_tests() -> dict[Path, dict[str, Any]]:
    """The promtool unit test files under deploy/prometheus/tests/, parsed."""
    return {path: yaml.safe_load(path.read_text()) for path in sorted(ALERT_TESTS.glob("*.yml"))}


def alerts_tested(test_files: list[dict[str, Any]], *, firing: bool) -> set[str]:
    """The alert names that some case expects to fire (firing=True) or to stay quiet."""
    return {
        case["alertname"]
        for document in test_files
        for group in document["tests"]
        for case in group.get("alert_rule_test", [])
        if bool(case.get("exp_alerts")) is firing
    }


def untested_alerts(rules: list[dict[str, Any]], test_files: list[dict[str, Any]]) -> set[str]:
    """Alerts without both a firing and a quiet case in the unit tests."""
    names = {rule["alert"] for rule in rules}
    covered = alerts_tested(test_files, firing=True) & alerts_tested(test_files, firing=False)
    return names - covered


needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed "
                                    "(Debian package prometheus; .ci/run installs it)")


@needs_promtool
def test_prometheus_config_and_rules_pass_promtool() -> None:
    """promtool accepts the Prometheus config, with the rule file it loads, and the alert rules."""
    config_check = promtool("check", "config", PROMETHEUS)
    assert config_check.returncode == 0, config_check.stdout + config_check.stderr
    rules_check = promtool("check", "rules", ALERTS)
    assert rules_check.returncode == 0, rules_check.stdout + rules_check.stderr


@needs_promtool
def test_alert_rules_pass_their_promtool_unit_tests() -> None:
    """`promtool test rules` passes on every file under deploy/prometheus/tests/."""
    files = list(alert_rule_tests())
    assert files
    result = promtool("test", "rules", *files)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_unit_tests_showing_it_firing_and_quiet() -> None:
    """Each alert in alerts.yml is expected to fire in one test case and to stay quiet in another."""
    tests = alert_rule_tests()
    for path, document in tests.items():
        rule_files = [(path.parent / name).resolve() for name in document["rule_files"]]
        assert rule_files == [ALERTS], path.name
    assert untested_alerts(alert_rules(), list(tests.values())) == set()


def test_an_alert_without_a_firing_case_counts_as_untested() -> None:
    """The coverage check names an alert that no unit test expects to fire."""
    tests = list(alert_rule_tests().values())
    new_rule = {"alert": "StoryjobsSomethingNew", "expr": "vector(1)"}
    quiet_only = {"tests": [{"alert_rule_test": [
        {"eval_time": "1m", "alertname": "StoryjobsSomethingNew", "exp_alerts": []}]}]}
    assert untested_alerts([*alert_rules(), new_rule], [*tests, quiet_only]) == {"StoryjobsSomethingNew"}


def test_prometheus_scrapes_api_sweeper_and_every_worker_replica() -> None:
    """Prometheus loads alerts.yml and finds worker replicas through compose DNS on port 9100."""
    prometheus = yaml.safe_load(PROMETHEUS.read_text())
    assert prometheus["rule_files"] == ["alerts.yml"]
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["storyjobs-worker"]["dns_sd_configs"] == [
        {"names": ["worker"], "type": "A", "port": 9100, "refresh_interval": "15s"}
    ]
    assert jobs["storyjobs-api"]["static_configs"][0]["targets"] == ["api:8000"]
    assert jobs["storyjobs-sweeper"]["static_configs"][0]["targets"] == ["sweeper:9101"]
    mounts = compose()["services"]["prometheus"]["volumes"]
    assert any(m.startswith("./prometheus/alerts.yml:") for m in mounts)
