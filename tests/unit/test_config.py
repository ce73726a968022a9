"""Configuration: parsed once from the environment, bad values named."""

from __future__ import annotations

import subprocess
import sys
from decimal import Decimal

import pytest

from shared.config import ApiSettings, ConfigError, SweeperSettings, WorkerSettings
from shared.config_load import load
from tests.support.host import REPO


def test_defaults_follow_the_design() -> None:
    """With an empty environment every setting has the documented default."""
    worker = load(WorkerSettings, {})
    assert (worker.worker_concurrency, worker.heartbeat_interval_s, worker.heartbeat_timeout_s) == (1, 10, 60)
    assert (worker.job_timeout_s, worker.llm_timeout_s, worker.offline_delay_s) == (480, 300, 3)
    assert worker.offline and worker.metrics_port == 9100
    api = load(ApiSettings, {})
    assert (api.queue_max, api.effective_client_queue_max, api.api_port) == (8, 4, 8000)
    assert load(SweeperSettings, {}).metrics_port == 9101
    # drafts on, once a second, for the worker that writes them and the api that paces the poll by them
    assert worker.draft_interval_s == 1 and api.draft_interval_s == 1
    assert load(WorkerSettings, {"DRAFT_INTERVAL_S": "0"}).draft_interval_s == 0


def test_values_are_converted_from_strings() -> None:
    """Numbers and JSON arrive as strings and are converted to their types."""
    worker = load(WorkerSettings, {"WORKER_CONCURRENCY": "4", "HEARTBEAT_INTERVAL_S": "0.5",
                                   "HEARTBEAT_TIMEOUT_S": "2", "LLM_PRICES": '{"m": [1.5, 7]}',
                                   "LLM_MODEL": "m", "ANTHROPIC_API_KEY": "k", "WORKER_LISTEN": "false"})
    assert worker.worker_concurrency == 4 and worker.heartbeat_interval_s == 0.5
    assert (worker.price().input_usd_per_mtok, worker.price().output_usd_per_mtok) == (Decimal("1.5"), Decimal("7.0"))
    assert worker.worker_listen is False


@pytest.mark.parametrize(
    ("settings_type", "environ", "message"),
    [
        (ApiSettings, {"QUEUE_MAX": "0"}, "QUEUE_MAX"),
        (ApiSettings, {"QUEUE_MAX": "lots"}, "QUEUE_MAX"),
        (ApiSettings, {"QUEUE_MAX": "5", "CLIENT_QUEUE_MAX": "6"}, "CLIENT_QUEUE_MAX"),
        (WorkerSettings, {"WORKER_CONCURRENCY": "-1"}, "WORKER_CONCURRENCY"),
        (WorkerSettings, {"LLM_TIMEOUT_S": "600"}, "LLM_TIMEOUT_S"),
        (WorkerSettings, {"HEARTBEAT_INTERVAL_S": "30"}, "HEARTBEAT_INTERVAL_S"),
        (WorkerSettings, {"ANTHROPIC_API_KEY": "k", "LLM_MODEL": "unpriced"}, "LLM_PRICES"),
        (WorkerSettings, {"LLM_PRICES": "{not json"}, "LLM_PRICES"),
        (WorkerSettings, {"DRAFT_INTERVAL_S": "-1"}, "DRAFT_INTERVAL_S"),
        (ApiSettings, {"DRAFT_INTERVAL_S": "often"}, "DRAFT_INTERVAL_S"),
        (SweeperSettings, {"LOG_FORMAT": "xml"}, "LOG_FORMAT"),
        (SweeperSettings, {"SWEEPER_INTERVAL_S": "0"}, "SWEEPER_INTERVAL_S"),
    ],
)
def test_a_bad_value_names_its_variable(settings_type: type, environ: dict[str, str], message: str) -> None:
    """Out-of-range, malformed and contradictory values raise ConfigError naming the variable."""
    with pytest.raises(ConfigError, match=message):
        load(settings_type, environ)


def test_a_process_with_a_bad_setting_exits_with_one_line() -> None:
    """A bad value stops the process at start with one line on stderr naming the variable."""
    result = subprocess.run([sys.executable, "-m", "worker"], cwd=REPO, capture_output=True, text=True,
                            env={"PATH": "", "WORKER_CONCURRENCY": "zero"}, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "WORKER_CONCURRENCY" in lines[0]


def test_a_retention_shorter_than_the_webhook_retry_schedule_is_refused() -> None:
    """JOB_RETENTION_S below the retry schedule's 28 hours stops the sweeper at start, naming both."""
    with pytest.raises(ConfigError, match=r"JOB_RETENTION_S \(86400\) must be at least the webhook retry schedule"):
        load(SweeperSettings, {"JOB_RETENTION_S": "86400"})
    # the schedule's waits (27.6 h) and the longest lease of each of the eight attempts
    assert load(SweeperSettings, {"JOB_RETENTION_S": "99825"}).job_retention_s == 99825


@pytest.mark.parametrize("retention_s", [str(30 * 86400), str(365 * 86400), "315576000", "3155760000"])
def test_a_retention_of_months_or_years_is_accepted(retention_s: str) -> None:
    """JOB_RETENTION_S takes the documented 30 days written out, a year, ten years and a century."""
    assert load(SweeperSettings, {"JOB_RETENTION_S": retention_s}).job_retention_s == float(retention_s)


def test_the_ledger_is_kept_unless_told_and_never_for_less_than_its_readers_need() -> None:
    """LEDGER_RETENTION_S unset keeps the ledger. Set, it must cover JOB_RETENTION_S (a job's charge is read
    from its rows) and the rollup's 8 days (recounted from them); a year is accepted."""
    assert load(SweeperSettings, {}).ledger_retention_s is None
    with pytest.raises(ConfigError, match=r"LEDGER_RETENTION_S \(2591999\) must be at least JOB_RETENTION_S "
                                          r"\(2592000\)"):
        load(SweeperSettings, {"LEDGER_RETENTION_S": "2591999"})
    with pytest.raises(ConfigError, match=r"LEDGER_RETENTION_S \(691199\) .* the minute rollup's 691200 s"):
        load(SweeperSettings, {"JOB_RETENTION_S": "99825", "LEDGER_RETENTION_S": "691199"})
    assert load(SweeperSettings, {"JOB_RETENTION_S": "99825", "LEDGER_RETENTION_S": "691200"}
                ).ledger_retention_s == 691200
    assert load(SweeperSettings, {"LEDGER_RETENTION_S": str(365 * 86400)}).ledger_retention_s == 365 * 86400


def test_a_retention_past_a_century_is_refused_naming_the_variable() -> None:
    """JOB_RETENTION_S beyond a century is a typo, refused at start with the variable's name."""
    with pytest.raises(ConfigError, match=r"^JOB_RETENTION_S: Expected `float` <= 3155760000"):
        load(SweeperSettings, {"JOB_RETENTION_S": "3155760001"})
