"""LLM calls through the real anthropic SDK against the fake provider: what is
retried, what fails the job, and what the ledger records."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from shared.config import WorkerSettings
from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer, Plan
from tests.support.database import client_id_of, enqueue, job_rows
from tests.support.settings import worker_settings
from tests.support.waiting import wait_until
from tests.support.workers import running_worker
from worker.anthropic_writer import AnthropicWriter
from worker.coordinator import Coordinator


async def _ledger(conn: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
    cur = await conn.execute(
        "SELECT attempt, outcome, billed, output_tokens, request_id FROM llm_calls ORDER BY job_id, attempt"
    )
    return await cur.fetchall()


async def _finished(conn: psycopg.AsyncConnection[Any], n: int = 1) -> bool:
    rows = await job_rows(conn)
    return len(rows) == n and all(r.status in ("completed", "failed") for r in rows)


@pytest.fixture
async def provider() -> AsyncIterator[FakeAnthropicServer]:
    with FakeAnthropicServer(FakeAnthropic(default=Plan(chunks=4))) as server:
        yield server


def _settings(provider: FakeAnthropicServer, **overrides: Any) -> WorkerSettings:
    return worker_settings(anthropic_api_key="test", anthropic_base_url=provider.base_url, **overrides)


async def _run_one(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str, settings: WorkerSettings,
    prompt: str = "a sleepy otter",
) -> None:
    client = await client_id_of(conn)
    writer = AnthropicWriter(settings)
    try:
        async with running_worker(settings, pool, writer, listen_url=database_url):
            await enqueue(conn, client, prompt)
            await wait_until(lambda: _finished(conn), timeout=20, what="the job to finish")
    finally:
        await writer.aclose()


async def test_rate_limited_and_overloaded_answers_are_retried_until_the_story_is_written(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer,
) -> None:
    """429 then 529 answers are retried (after their Retry-After) and the job completes with one billed call."""
    provider.fake.queue(Plan(status=429, retry_after_ms=20), Plan(status=529, retry_after_ms=20))
    await _run_one(conn, pool, database_url, _settings(provider))
    (job,) = await job_rows(conn)
    assert job.status == "completed"
    assert [c.status for c in provider.fake.calls] == [429, 529, 200]
    assert len(provider.fake.billed) == 1
    ledger = await _ledger(conn)
    assert [(a, o, b) for a, o, b, _, _ in ledger] == [
        (1, "rate_limited", False), (2, "overloaded", False), (3, "succeeded", True)]
    assert ledger[2][4] == provider.fake.billed[0].request_id


async def test_a_refused_connection_is_retried(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
) -> None:
    """Nothing listening at the provider's address: each attempt is recorded unbilled and the job
    fails as llm_unavailable once the attempts run out."""
    from tests.support.host import free_port

    settings = worker_settings(anthropic_api_key="test", anthropic_base_url=f"http://127.0.0.1:{free_port()}",
                               llm_retry_attempts=3)
    await _run_one(conn, pool, database_url, settings)
    (job,) = await job_rows(conn)
    assert job.status == "failed" and job.error_code == "llm_unavailable"
    assert [(a, o, b) for a, o, b, _, _ in await _ledger(conn)] == [
        (1, "connect_failed", False), (2, "connect_failed", False), (3, "connect_failed", False)]


async def test_a_read_timeout_mid_stream_fails_the_job_without_a_retry(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer,
) -> None:
    """A stream that stalls after it started is abandoned at the read timeout and never retried:
    the job fails as llm_error and the provider saw exactly one request."""
    provider.fake.queue(Plan(chunks=6, stall_after=2, stall_s=30))
    await _run_one(conn, pool, database_url, _settings(provider, llm_read_timeout_s=0.5))
    (job,) = await job_rows(conn)
    assert job.status == "failed" and job.error_code == "llm_error"
    assert len(provider.fake.calls) == 1
    ((attempt, outcome, billed, _, _),) = await _ledger(conn)
    assert (attempt, outcome, billed) == (1, "failed", True)


@pytest.mark.parametrize(
    "plan",
    [Plan(chunks=6, drop_after=3), Plan(chunks=6, error_event_after=2)],
    ids=["dropped-connection", "overloaded-error-event"],
)
async def test_a_stream_that_breaks_after_it_started_fails_the_job_without_a_retry(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer, plan: Plan,
) -> None:
    """The provider cutting the connection, or sending an overloaded error, inside a started stream
    may have billed: the job fails as llm_error, with no retry."""
    provider.fake.queue(plan)
    await _run_one(conn, pool, database_url, _settings(provider))
    (job,) = await job_rows(conn)
    assert job.status == "failed" and job.error_code == "llm_error"
    assert len(provider.fake.calls) == 1


@pytest.mark.parametrize("status", [400, 404])
async def test_a_rejected_request_fails_at_once_with_a_readable_error(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer, status: int,
) -> None:
    """A provider 4xx (e.g. an invalid model) fails the job as llm_rejected, unbilled and unretried."""
    provider.fake.queue(Plan(status=status))
    await _run_one(conn, pool, database_url, _settings(provider))
    (job,) = await job_rows(conn)
    assert job.status == "failed" and job.error_code == "llm_rejected"
    cur = await conn.execute("SELECT error_text FROM story_jobs")
    row = await cur.fetchone()
    assert row is not None
    (error_text,) = row
    assert f"rejected the request ({status})" in error_text
    assert len(provider.fake.calls) == 1
    assert [(a, o, b) for a, o, b, _, _ in await _ledger(conn)] == [(1, "rejected", False)]


async def test_a_5xx_before_the_stream_is_not_retried(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer,
) -> None:
    """A 500 is not certainly unbilled, so it fails the job rather than risk a second bill."""
    provider.fake.queue(Plan(status=500))
    await _run_one(conn, pool, database_url, _settings(provider))
    (job,) = await job_rows(conn)
    assert job.status == "failed" and job.error_code == "llm_error"
    assert len(provider.fake.calls) == 1


async def test_usage_and_cost_are_stored_with_the_story(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer,
) -> None:
    """The provider's final usage becomes the story's and the ledger's tokens, priced from the table."""
    provider.fake.default = Plan(chunks=5, words_per_chunk=10)
    settings = _settings(provider, llm_model="priced-model", llm_prices={"priced-model": (2.0, 10.0)})
    await _run_one(conn, pool, database_url, settings)
    cur = await conn.execute("SELECT input_tokens, output_tokens, cost_usd FROM stories")
    stored = await cur.fetchone()
    cur = await conn.execute("SELECT input_tokens, output_tokens, cost_usd FROM llm_calls")
    assert await cur.fetchone() == stored
    assert stored is not None
    input_tokens, output_tokens, cost = stored
    assert output_tokens == 4 * 10 + 4  # the title line has 4 words, then 4 chunks of 10
    assert input_tokens > 0
    assert float(cost) == pytest.approx((input_tokens * 2 + output_tokens * 10) / 1_000_000, abs=1e-6)


async def test_progress_grows_while_the_story_streams(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer,
) -> None:
    """Heartbeats carry the output tokens streamed so far into the job's progress."""
    provider.fake.default = Plan(chunks=30, duration_s=3.0, words_per_chunk=8)
    settings = _settings(provider, heartbeat_interval_s=0.2)
    client = await client_id_of(conn)
    writer = AnthropicWriter(settings)
    seen: list[int] = []
    try:
        async with running_worker(settings, pool, writer, listen_url=database_url):
            await enqueue(conn, client, "a patient snail")

            async def record() -> bool:
                (job,) = await job_rows(conn)
                if job.status == "running":
                    seen.append(job.progress)
                return job.status == "completed"

            await wait_until(record, timeout=20, what="the job to complete")
    finally:
        await writer.aclose()
    increasing = [p for p in seen if p > 0]
    assert len(set(increasing)) >= 3, seen
    assert increasing == sorted(increasing)


async def test_a_swept_job_has_its_stream_closed_at_the_next_heartbeat(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer,
) -> None:
    """When the sweeper fails a running job, its worker closes the stream at the next heartbeat (long
    before it would have ended), records the partial usage as stopped, and does not complete the job."""
    from datetime import UTC, datetime, timedelta

    from sweeper.store import PgSweeperStore

    provider.fake.default = Plan(chunks=200, duration_s=60)
    interval = 0.3
    settings = _settings(provider, heartbeat_interval_s=interval)
    client = await client_id_of(conn)
    writer = AnthropicWriter(settings)
    try:
        with capture_logs() as logs:
            async with running_worker(settings, pool, writer, listen_url=database_url) as worker:
                await enqueue(conn, client, "a restless moon")
                await asyncio.to_thread(provider.fake.wait_for, lambda f: f.calls and f.calls[0].chunks_sent >= 2)
                swept = await PgSweeperStore(conn).fail_stale(
                    heartbeat_timeout_s=60, job_timeout_s=480, pending_timeout_s=1800,
                    judge_running=True, batch_size=10, lock_timeout_s=5, now=datetime.now(UTC) + timedelta(hours=1))
                assert len(swept) == 1
                await asyncio.to_thread(provider.fake.wait_for, lambda f: f.calls[0].closed_early, 10)
                await wait_until(lambda: _no_jobs_held(worker), what="the worker to let the job go")
    finally:
        await writer.aclose()
    assert provider.fake.calls[0].chunks_sent < 200
    (job,) = await job_rows(conn)
    assert job.status == "failed" and job.story_id is None
    ((attempt, outcome, billed, output_tokens, request_id),) = await _ledger(conn)
    assert (attempt, outcome, billed) == (1, "stopped", True) and output_tokens > 0
    # the stream was stopped, not answered: its request id is still the one to take up with the provider
    assert request_id == provider.fake.calls[0].request_id
    assert any(e["event"] == "job.lost_ownership" for e in logs)
    assert not any(e["event"] in ("job.completed", "job.lost_race") for e in logs)


async def _no_jobs_held(worker: Coordinator) -> bool:
    return not worker.held_job_ids


@pytest.mark.parametrize("plan", [Plan(status=500), Plan(chunks=8, drop_after=3),
                                  Plan(chunks=6, stall_after=2, stall_s=30)], ids=["500", "dropped", "stalled"])
async def test_a_billed_call_that_did_not_succeed_keeps_the_providers_request_id(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer, plan: Plan,
) -> None:
    """A 500 before the stream, a stream the connection dropped and one that stalled past the read timeout
    may all have been billed: their ledger row keeps the provider's request id, the one an operator takes up
    with the provider."""
    provider.fake.queue(plan)
    # the read timeout ends the stalled stream; long enough that the other
    # two answer first on a slow machine
    await _run_one(conn, pool, database_url, _settings(provider, llm_retry_attempts=1, llm_read_timeout_s=2.0))
    ledger = await _ledger(conn)
    first = provider.fake.calls[0]
    assert ledger[0][2] is True and ledger[0][4] == first.request_id, (ledger, first.request_id)
