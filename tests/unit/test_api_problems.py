"""The api's error answers and settings, without a database."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from litestar import Litestar, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import JSONBody
from structlog.testing import capture_logs

from api import pacing
from api.enqueue import budget_retry_after
from api.problems import EXCEPTION_HANDLERS
from api.rows import DrainStats
from shared.config import ApiSettings, ConfigError
from shared.status import JobStatus

SECRET = "sj_0123456789ab_" + "S" * 43


@post("/boom")
async def boom(data: JSONBody[dict[str, str]]) -> None:
    prompt = data["prompt"]
    raise RuntimeError(f"failed on {prompt!r} with {SECRET}")


async def test_an_unexpected_error_is_a_bare_500_logged_without_its_message_or_locals() -> None:
    """A bug answers a 500 problem with no detail, and its log line names the exception's type and where it was
    raised, never its message, the request or local variables (a prompt or a key could be in any of them)."""
    app = Litestar([boom], exception_handlers=EXCEPTION_HANDLERS)
    with capture_logs() as logs:
        # Litestar types the ASGI scope narrower than httpx does; the app is the same ASGI app
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            answer = await client.post("/boom", json={"prompt": "a story for Amelia"},
                                       headers={"Authorization": f"Bearer {SECRET}"})
    assert answer.status_code == 500 and answer.json() == {"title": "Internal Server Error", "status": 500}
    assert answer.headers["content-type"] == "application/problem+json"
    (event,) = logs
    assert event["event"] == "api.unhandled_error" and event["error"] == "RuntimeError"
    assert event["route"] == "/boom" and any("in boom" in frame for frame in event["raised_at"])
    assert "exc_info" not in event and "Amelia" not in repr(logs) and SECRET not in repr(logs)


async def _deadline() -> AsyncIterator[None]:
    async with asyncio.timeout(0.05):
        yield None


@get("/slow")
async def slow(deadline: NamedDependency[None]) -> None:
    await asyncio.sleep(5)


async def test_a_deadline_a_generator_dependency_holds_answers_503_when_it_expires_in_the_handler() -> None:
    """The TimeoutError a dependency's deadline raises when thrown the handler's cancellation, which Litestar
    raises in an ExceptionGroup, is the same 503 problem with Retry-After as any database outage."""
    app = Litestar([slow], dependencies={"deadline": Provide(_deadline)}, exception_handlers=EXCEPTION_HANDLERS)
    with capture_logs() as logs:
        # Litestar types the ASGI scope narrower than httpx does; the app is the same ASGI app
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            answer = await client.get("/slow")
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5", answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert [(event["event"], event["error"]) for event in logs] == [("api.database_unavailable", "TimeoutError")]


def test_a_request_timeout_not_beyond_the_connection_wait_is_refused() -> None:
    """API_REQUEST_TIMEOUT_S must be longer than API_DB_WAIT_S, which it would otherwise cut short."""
    with pytest.raises(ConfigError, match="API_REQUEST_TIMEOUT_S"):
        ApiSettings(api_db_wait_s=3.0, api_request_timeout_s=3.0)


def _drain(**fields: Any) -> DrainStats:
    return DrainStats(**{"pending": 8, "running": 0, "avg_run_seconds": None, "avg_output_tokens": None, **fields})


@pytest.mark.parametrize(
    ("stats", "seconds"),
    [
        (None, 5),
        # nothing measured yet (one claim is not a rate): soon
        (_drain(running=2, claimed_last_minute=1), 5),
        # no job finished yet, but 5 claimed in the last minute: one every 12 s
        (_drain(running=4, claimed_last_minute=5), 12),
        # 40 s stories, the oldest running 35 s in: a slot frees in 5 s (the claim rate gives way)
        (_drain(running=2, avg_run_seconds=40.0, longest_running_s=35.0, claimed_last_minute=2), 5),
        # 12 s stories in two slots started together 0.5 s ago: 12 s, not a slot's share of 6 s
        (_drain(running=2, avg_run_seconds=12.0, longest_running_s=0.5), 12),
        # the oldest overdue: one slot's share of a run
        (_drain(running=2, avg_run_seconds=40.0, longest_running_s=90.0), 20),
        (_drain(running=200, avg_run_seconds=90.0, longest_running_s=120.0), 1),
        # a stalled queue is asked about again within a minute, never later
        (_drain(running=1, avg_run_seconds=600.0), 60),
    ],
)
def test_a_full_queue_asks_to_retry_after_the_queue_should_take_its_next_job(
    stats: DrainStats | None, seconds: int
) -> None:
    """Retry-After after a 429 is when the queue should take its next job at its drain rate (the oldest running
    job's expected end, one slot's share of a run when it is overdue, else the last minute's claims), 5 s when
    nothing is measured."""
    assert pacing.queue_full_retry_after(stats) == seconds


@pytest.mark.parametrize(
    ("day_ends_in_s", "seconds"),
    [(86_399.2, 86_400), (3_600.0, 3_600), (1.2, 2), (1.0, 1), (0.4, 1), (0.0, 1)],
)
def test_a_spent_budget_asks_to_retry_at_midnight_utc_and_in_its_last_second_after_one(
    day_ends_in_s: float, seconds: int
) -> None:
    """Retry-After after a budget 429 is the seconds to midnight UTC rounded up, never before the reset and
    never 0: in the day's last second, 1."""
    assert budget_retry_after(day_ends_in_s) == seconds


@pytest.mark.parametrize(
    ("progress", "max_tokens", "percent"),
    [(0, 800, 0), (220, 800, 50), (440, 800, 99), (5000, 800, 99), (100, None, None)],
)
def test_a_running_job_reports_its_percentage_against_its_expected_length(
    progress: int, max_tokens: int | None, percent: int | None
) -> None:
    """A running job's percentage is its output against what its length usually writes, never 100 before done."""
    fraction = pacing.fraction_done(progress, max_tokens)
    assert pacing.percent_done(JobStatus.RUNNING, fraction) == percent
    assert pacing.percent_done(JobStatus.PENDING, fraction) == 0
    assert pacing.percent_done(JobStatus.COMPLETED, fraction) == 100
