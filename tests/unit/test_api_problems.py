"""The api's error answers and settings, without a database."""

from __future__ import annotations

import httpx
import pytest
from litestar import Litestar, post
from litestar.params import JSONBody
from structlog.testing import capture_logs

from api import pacing
from api.problems import EXCEPTION_HANDLERS
from shared.config import ApiSettings, ConfigError
from shared.rows import DrainStats

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
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            answer = await client.post("/boom", json={"prompt": "a story for Amelia"},
                                       headers={"Authorization": f"Bearer {SECRET}"})
    assert answer.status_code == 500 and answer.json() == {"title": "Internal Server Error", "status": 500}
    assert answer.headers["content-type"] == "application/problem+json"
    (event,) = logs
    assert event["event"] == "api.unhandled_error" and event["error"] == "RuntimeError"
    assert event["route"] == "/boom" and any("in boom" in frame for frame in event["raised_at"])
    assert "exc_info" not in event and "Amelia" not in repr(logs) and SECRET not in repr(logs)


def test_a_request_timeout_not_beyond_the_connection_wait_is_refused() -> None:
    """API_REQUEST_TIMEOUT_S must be longer than API_DB_WAIT_S, which it would otherwise cut short."""
    with pytest.raises(ConfigError, match="API_REQUEST_TIMEOUT_S"):
        ApiSettings(api_db_wait_s=3.0, api_request_timeout_s=3.0)


@pytest.mark.parametrize(
    ("stats", "seconds"),
    [
        (None, 30),
        (DrainStats(pending=8, running=0, avg_run_seconds=90.0, avg_output_tokens=900.0), 30),
        (DrainStats(pending=8, running=3, avg_run_seconds=90.0, avg_output_tokens=900.0), 30),
        (DrainStats(pending=8, running=6, avg_run_seconds=90.0, avg_output_tokens=900.0), 15),
        (DrainStats(pending=8, running=200, avg_run_seconds=90.0, avg_output_tokens=900.0), 1),
    ],
)
def test_a_full_queue_asks_to_retry_after_one_job_should_have_started(
    stats: DrainStats | None, seconds: int
) -> None:
    """Retry-After after a 429 is the time for one pending job to start at the current drain rate (jobs running
    over their average run time), 30 s when nothing drains yet."""
    assert pacing.queue_full_retry_after(stats) == seconds
