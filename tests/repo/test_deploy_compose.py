"""deploy/docker-compose.yml starts the three processes after the migration,
with settings they accept and timeouts consistent with the worker's shutdown."""

from __future__ import annotations

import shlex

from shared import config_load
from tests.repo.deploy_files import SETTINGS_BY_COMPONENT, compose, compose_env, duration_s
from worker.coordinator import SHUTDOWN_FLUSH_S


def test_compose_runs_the_three_entrypoints_and_migrate() -> None:
    """The compose services start api, worker, sweeper and `storyjobs migrate`."""
    services = compose()["services"]
    commands = {name: shlex.join(service["command"]) for name, service in services.items()
                if "command" in service and name != "prometheus"}
    assert commands == {
        "migrate": "storyjobs migrate",
        "api": "python -m api",
        "worker": "python -m worker",
        "sweeper": "python -m sweeper",
    }


def test_compose_services_wait_for_migrate_which_waits_for_healthy_postgres() -> None:
    """api, worker and sweeper start after migrate succeeded; migrate after postgres is healthy."""
    services = compose()["services"]
    assert services["postgres"]["healthcheck"]["test"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("api", "worker", "sweeper"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name
    assert services["migrate"].get("restart") == "no"


def test_compose_worker_can_be_scaled_and_exposes_metrics_inside_the_network() -> None:
    """The worker has no fixed name or published port, and serves metrics on 9100."""
    worker = compose()["services"]["worker"]
    assert "container_name" not in worker
    assert "ports" not in worker
    assert compose_env(worker)["METRICS_PORT"] == "9100"


def test_compose_api_listens_on_all_interfaces_and_is_published() -> None:
    """The api binds 0.0.0.0 inside its container and publishes its port."""
    api = compose()["services"]["api"]
    assert compose_env(api)["API_HOST"] == "0.0.0.0"
    assert any(str(port).endswith(":8000") for port in api["ports"])


def test_compose_worker_stop_grace_exceeds_its_shutdown_grace() -> None:
    """Docker waits longer than the worker's own grace plus its final flush before SIGKILL."""
    worker = compose()["services"]["worker"]
    grace = float(compose_env(worker)["WORKER_SHUTDOWN_GRACE_S"])
    assert duration_s(worker["stop_grace_period"]) > grace + SHUTDOWN_FLUSH_S


def test_compose_settings_pass_the_processes_own_validation() -> None:
    """Each compose service's environment loads without a configuration error."""
    services = compose()["services"]
    for name, settings_type in SETTINGS_BY_COMPONENT.items():
        env = {**compose_env(services[name]), "ANTHROPIC_API_KEY": "sk-test"}
        config_load.load(settings_type, env)
