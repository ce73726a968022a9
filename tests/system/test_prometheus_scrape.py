"""A real Prometheus server scrapes the real api, workers and sweeper, with the
job names of deploy/prometheus/prometheus.yml and the alert rules loaded, and
sees every target up and the storyjobs_ series of each kind of process."""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.database import create_key_sync
from tests.support.outcome import failed_in_call
from tests.support.waiting import wait_until_sync
from tests.system.procs import REPO, System, free_port

PROMETHEUS = shutil.which("prometheus")
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus server is not installed "
                       "(Debian package prometheus; .ci/run installs it)"),
]


class PrometheusServer:
    """The prometheus binary on a free loopback port, scraping every second, its
    data and log in a directory of the test's."""

    def __init__(self, directory: Path, scrape_configs: list[dict[str, Any]]) -> None:
        assert PROMETHEUS is not None
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = directory / "prometheus.log"
        config_path = directory / "prometheus.yml"
        config_path.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": scrape_configs,
        }))
        self._log_file = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config_path}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self._log_file, stderr=subprocess.STDOUT,
        )

    def api(self, path: str, **params: str) -> Any:
        """The `data` of an answer of Prometheus' HTTP API."""
        answer = httpx.get(f"{self.base_url}/api/v1/{path}", params=params, timeout=5).json()
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def wait_until(self, what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
        """Polls `check` until it holds; fails with `what` and the server's log if it never does."""
        def seen() -> bool:
            if self.process.poll() is not None:
                pytest.fail(f"prometheus exited ({self.process.returncode}):\n{self.log()[-3000:]}")
            try:
                return check()
            except httpx.HTTPError:
                return False  # not listening yet

        try:
            wait_until_sync(seen, timeout=timeout_s, interval=0.2, what=what)
        except TimeoutError:
            pytest.fail(f"prometheus never saw {what}:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log_file.close()
        return self.process.returncode


@pytest.fixture
def start_prometheus(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., PrometheusServer]]:
    """Starts the Prometheus server of the test; stops it at the end and shows its log if the test failed."""
    started: list[PrometheusServer] = []

    def start(scrape_configs: list[dict[str, Any]]) -> PrometheusServer:
        directory = tmp_path / "prometheus"
        directory.mkdir()
        server = PrometheusServer(directory, scrape_configs)
        started.append(server)
        # it listens before its storage is open, answering 503 until then
        server.wait_until("itself ready", lambda: httpx.get(f"{server.base_url}/-/ready", timeout=5).is_success)
        return server

    yield start
    for server in started:
        server.stop()
        if failed_in_call(request):
            # pytest shows a failed test's output: the server's last log lines
            print(f"----- {server.log_path} -----\n{server.log()[-4000:]}")  # noqa: T201


def _series_by_job(server: PrometheusServer, expr: str) -> dict[str, list[dict[str, str]]]:
    found: dict[str, list[dict[str, str]]] = {}
    for sample in server.query(expr):
        found.setdefault(sample["metric"]["job"], []).append(sample["metric"])
    return found


def test_prometheus_scrapes_every_process_and_receives_their_series(
    system: System, start_prometheus: Callable[..., PrometheusServer], database_url: str
) -> None:
    """Prometheus finds the api, two workers and the sweeper up, receives storyjobs_ series from each,
    and evaluates every alert rule against them without error."""
    api = system.api()
    worker_ports = [free_port(), free_port()]
    for port in worker_ports:
        system.worker(METRICS_PORT=port, OFFLINE_DELAY_S=0.05)
    sweeper_port = free_port()
    system.sweeper(METRICS_PORT=sweeper_port, SWEEPER_INTERVAL_S=1)
    # one job through the system, so that the request and transition counters move
    key = create_key_sync(database_url, "prometheus")
    accepted = httpx.post(f"{api.base_url}/stories/generate", json={"prompt": "a scraped story"},
                          headers={"Authorization": f"Bearer {key}", "Idempotency-Key": "scraped"}, timeout=10)
    assert accepted.status_code == 202, accepted.text

    targets = {
        "storyjobs-api": [f"127.0.0.1:{api.port}"],
        "storyjobs-worker": [f"127.0.0.1:{port}" for port in worker_ports],
        "storyjobs-sweeper": [f"127.0.0.1:{sweeper_port}"],
    }
    server = start_prometheus(
        [{"job_name": job, "static_configs": [{"targets": addresses}]} for job, addresses in targets.items()]
    )
    every_target = sum(len(addresses) for addresses in targets.values())

    def all_up() -> bool:
        up = server.query('up{job=~"storyjobs.*"}')
        return len(up) == every_target and all(sample["value"][1] == "1" for sample in up)

    server.wait_until("every target up", all_up)
    active = server.api("targets")["activeTargets"]
    assert {(t["labels"]["job"], t["labels"]["instance"]) for t in active} == {
        (job, address) for job, addresses in targets.items() for address in addresses
    }
    assert all(target["health"] == "up" for target in active), active

    server.wait_until("the completed job counted", lambda: bool(
        server.query('sum(storyjobs_job_transitions_total{to="completed"}) == 1')))
    slots = _series_by_job(server, "storyjobs_worker_slots")
    assert sorted(m["instance"] for m in slots["storyjobs-worker"]) == sorted(targets["storyjobs-worker"])
    assert set(slots) == {"storyjobs-worker"}
    last_run = _series_by_job(server, "storyjobs_sweeper_last_run_timestamp_seconds")
    assert [m["instance"] for m in last_run["storyjobs-sweeper"]] == targets["storyjobs-sweeper"]
    requests = _series_by_job(server, 'storyjobs_http_requests_total{route="/stories/generate", status="202"}')
    assert [m["instance"] for m in requests["storyjobs-api"]] == targets["storyjobs-api"]
    # each kind of process exports its own families, and only those
    jobs_with_series = {
        name: set(_series_by_job(server, f'{{__name__=~"{name}"}}'))
        for name in ("storyjobs_jobs_accepted_total", "storyjobs_job_transitions_total", "storyjobs_jobs")
    }
    assert jobs_with_series == {
        "storyjobs_jobs_accepted_total": {"storyjobs-api"},
        "storyjobs_job_transitions_total": {"storyjobs-worker"},
        "storyjobs_jobs": {"storyjobs-sweeper"},
    }

    def rules_evaluated() -> bool:
        rules = [rule for group in server.api("rules")["groups"] for rule in group["rules"]]
        return bool(rules) and all(rule["health"] != "unknown" for rule in rules)

    server.wait_until("every alert rule evaluated", rules_evaluated)
    rules = [rule for group in server.api("rules")["groups"] for rule in group["rules"]]
    assert len(rules) == len(yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"])
    assert {rule["name"]: rule["health"] for rule in rules if rule["health"] != "ok"} == {}
    assert server.stop() == 0
