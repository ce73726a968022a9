"""Each process's settings as the tests start it: fast timings, no metrics
port; a test passes the values it depends on."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, TypedDict

from shared.config import ApiSettings, SweeperSettings, WorkerSettings

# fast timings for tests; each test states the ones it depends on
FAST = {
    "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 1.0,
    "job_timeout_s": 30.0,
    "pending_timeout_s": 60.0,
}


class SweepRules(TypedDict):
    """PgSweeperStore.fail_stale's rules, as keyword arguments."""

    heartbeat_timeout_s: float
    job_timeout_s: float
    pending_timeout_s: float
    judge_running: bool
    batch_size: int
    lock_timeout_s: float


# A sweeper pass (PgSweeperStore.fail_stale) as if run two hours from now: every
# running job's heartbeat and every job's age is then past these timeouts.
LATER = datetime.now(UTC) + timedelta(hours=2)
SWEEP = SweepRules(heartbeat_timeout_s=60.0, job_timeout_s=480.0, pending_timeout_s=1800.0,
                   judge_running=True, batch_size=100, lock_timeout_s=5.0)


def worker_settings(**overrides: Any) -> WorkerSettings:
    values: dict[str, Any] = {**FAST, "llm_timeout_s": 20.0, "llm_read_timeout_s": 5.0,
                              "worker_poll_interval_s": 0.5, "offline_delay_s": 0.0, "metrics_port": 0,
                              "worker_shutdown_grace_s": 5.0, **overrides}
    return WorkerSettings(**values)


def sweeper_settings(**overrides: Any) -> SweeperSettings:
    return SweeperSettings(**{**FAST, "sweeper_interval_s": 0.5, "metrics_port": 0, **overrides})


def api_settings(**overrides: Any) -> ApiSettings:
    """A test that sets queue_max tests the whole queue: one client may fill
    it unless the test sets client_queue_max (None: the default, half)."""
    if "queue_max" in overrides:
        overrides.setdefault("client_queue_max", overrides["queue_max"])
    return ApiSettings(**{"queue_max": 1000, **overrides})
