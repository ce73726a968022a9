"""Faults that real deployments meet, each forced on a real Postgres: provider
answers that must end a job at once, text the database cannot store, a job
ended elsewhere while its call waits to be retried, and the ledger rows such
endings leave open. Orderings are forced with row locks, never with sleeps."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from api.store import ApiStore
from shared.status import LlmOutcome
from sweeper.store import PgSweeperStore
from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer, Plan
from tests.support import worker_statements
from tests.support.database import client_id_of, enqueue, job_rows, waiting_on_a_lock
from tests.support.settings import LATER, SWEEP, worker_settings
from tests.support.waiting import wait_until
from tests.support.workers import running_worker
from worker.anthropic_writer import AnthropicWriter


async def _ledger(conn: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
    cur = await conn.execute("SELECT attempt, outcome, billed, finished_at IS NOT NULL FROM llm_calls "
                             "ORDER BY job_id, attempt")
    return await cur.fetchall()


async def _finished(conn: psycopg.AsyncConnection[Any]) -> bool:
    return all(row.status in ("completed", "failed") for row in await job_rows(conn))


async def _claim(conn: psycopg.AsyncConnection[Any], worker_id: str = "w1") -> int:
    result = await worker_statements.job_claim(conn, worker_id=worker_id, claim_limit=1,
                                              provider="anthropic", model="m")
    (job,) = result.claimed
    return job.id


async def _run_one(conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
                   provider: FakeAnthropicServer, **settings: Any) -> None:
    worker = worker_settings(anthropic_api_key="test", anthropic_base_url=provider.base_url, **settings)
    writer = AnthropicWriter(worker)
    try:
        async with running_worker(worker, pool, writer, listen_url=database_url):
            await enqueue(conn, await client_id_of(conn), "a sleepy owl")
            await wait_until(lambda: _finished(conn), timeout=20, what="the job to finish")
    finally:
        await writer.aclose()


async def test_a_429_that_says_do_not_retry_fails_the_job_at_once(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str
) -> None:
    """A 429 with x-should-retry: false (a spend limit reached) is final: one request, the job fails
    as llm_rejected with the provider's reason, and the ledger says rate_limited, not billed."""
    fake = FakeAnthropic()
    fake.queue(Plan(status=429, retry_after_ms=10, should_retry=False))
    with FakeAnthropicServer(fake) as provider:
        await _run_one(conn, pool, database_url, provider)
    (job,) = await job_rows(conn)
    assert (job.status, job.error_code) == ("failed", "llm_rejected")
    assert len(fake.calls) == 1
    assert await _ledger(conn) == [(1, "rate_limited", False, True)]


async def test_a_story_holding_nul_and_stray_surrogates_is_stored(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str
) -> None:
    """Text Postgres cannot store, in the title and the story, does not fail the job: it completes,
    with NUL removed."""
    fake = FakeAnthropic(default=Plan(chunks=2, text="Title: The Owl\x00 Who Hooted\nOnce\x00 upon a time."))
    with FakeAnthropicServer(fake) as provider:
        await _run_one(conn, pool, database_url, provider)
    (job,) = await job_rows(conn)
    assert job.status == "completed"
    cur = await conn.execute("SELECT title, body FROM stories")
    assert await cur.fetchone() == ("The Owl Who Hooted", "Once upon a time.")


async def test_a_job_cancelled_while_its_call_waits_to_be_retried_sends_no_request(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str
) -> None:
    """Cancelled during a 429's retry-after, well before the next heartbeat: the retry finds the job
    gone, opens no ledger row and sends nothing; the 429's row is closed as not billed."""
    fake = FakeAnthropic()
    fake.queue(Plan(status=429, retry_after_ms=2000))
    with FakeAnthropicServer(fake) as provider:
        settings = worker_settings(anthropic_api_key="test", anthropic_base_url=provider.base_url,
                                   heartbeat_interval_s=20, heartbeat_timeout_s=60)
        writer = AnthropicWriter(settings)
        try:
            async with running_worker(settings, pool, writer, listen_url=database_url) as worker:
                job_id = await enqueue(conn, await client_id_of(conn), "a sleepy owl")
                await asyncio.to_thread(fake.wait_for, lambda f: len(f.calls) == 1)
                cancelled = await ApiStore(conn).job_cancel(client_id=await client_id_of(conn), job_id=job_id)
                assert cancelled is not None and cancelled.cancelled
                await wait_until(lambda: not worker.held_job_ids, timeout=10, what="the worker to let the job go")
        finally:
            await writer.aclose()
    assert len(fake.calls) == 1
    assert await _ledger(conn) == [(1, "rate_limited", False, True)]


async def test_cancelling_a_job_whose_worker_died_closes_its_open_call(conn: psycopg.AsyncConnection[Any]) -> None:
    """A running job whose worker is gone, cancelled by its client: its open ledger row is closed as
    interrupted (assumed billed) by the cancellation itself."""
    client = await client_id_of(conn)
    job_id = await enqueue(conn, client, "a fox")
    await _claim(conn, "dead-worker")
    result = await ApiStore(conn).job_cancel(client_id=client, job_id=job_id)
    assert result is not None and result.cancelled
    assert await _ledger(conn) == [(1, "interrupted", True, True)]


@pytest.mark.parametrize("ender", ["cancel", "sweeper"])
async def test_a_retry_row_opened_while_the_job_is_being_ended_is_closed_by_whoever_ends_it(
    database_url: str, conn: psycopg.AsyncConnection[Any], ender: str
) -> None:
    """The retry's row is written first and holds the job's row while a cancellation (or a sweep) waits
    for it: once the retry commits, the job is ended and the new row closed in the same transaction;
    no row stays open for a finished job."""
    client = await client_id_of(conn)
    job_id = await enqueue(conn, client, "a fox")
    job = await _claim(conn)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as worker_conn:
        async with worker_conn.transaction():
            started = await worker_statements.llm_call_start(worker_conn, worker_id="w1", job_id=job, previous_attempt=1,
                                                 previous_outcome=LlmOutcome.RATE_LIMITED, previous_error="429")
            assert started.attempt == 2
            if ender == "cancel":
                ending = asyncio.create_task(ApiStore(conn).job_cancel(client_id=client, job_id=job_id))
                await wait_until(lambda: waiting_on_a_lock(worker_conn), what="the cancellation to wait")
            else:
                # SKIP LOCKED: the sweeper passes over a job whose row is held
                assert await PgSweeperStore(conn).fail_stale(now=LATER, **SWEEP) == []
        if ender == "cancel":
            ended = await ending
            assert ended is not None and ended.cancelled
        else:
            assert len(await PgSweeperStore(conn).fail_stale(now=LATER, **SWEEP)) == 1
    assert await _ledger(conn) == [(1, "rate_limited", False, True), (2, "interrupted", True, True)]


async def test_a_retry_waiting_on_a_cancellation_opens_no_row(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The other ordering: the cancellation holds the job's row, the retry waits, then finds the job
    no longer running and opens nothing (so nothing is sent)."""
    client = await client_id_of(conn)
    job_id = await enqueue(conn, client, "a fox")
    job = await _claim(conn)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as api_conn:
        async with api_conn.transaction():
            cancelled = await ApiStore(api_conn).job_cancel(client_id=client, job_id=job_id)
            assert cancelled is not None and cancelled.cancelled
            retry = asyncio.create_task(worker_statements.llm_call_start(
                conn, worker_id="w1", job_id=job, previous_attempt=1, previous_outcome=LlmOutcome.RATE_LIMITED,
                previous_error="429"))
            await wait_until(lambda: waiting_on_a_lock(api_conn), what="the retry to wait")
        started = await retry
        assert started.attempt is None and not started.owned
    assert await _ledger(conn) == [(1, "rate_limited", False, True)]


async def test_a_retry_of_a_cancelled_job_opens_no_row_while_its_worker_runs_others(
    conn: psycopg.AsyncConnection[Any]
) -> None:
    """A retry asks about its own job: when that job was cancelled, no row is opened (so nothing is sent)
    even though the same worker still runs other jobs."""
    client = await client_id_of(conn)
    cancelled_id = await enqueue(conn, client, "a fox")
    await enqueue(conn, client, "a hen")
    cancelled_job, running_job = await _claim(conn), await _claim(conn)
    outcome = await ApiStore(conn).job_cancel(client_id=client, job_id=cancelled_id)
    assert outcome is not None and outcome.cancelled
    started = await worker_statements.llm_call_start(
        conn, worker_id="w1", job_id=cancelled_job, previous_attempt=1, previous_outcome=LlmOutcome.RATE_LIMITED,
        previous_error="429")
    assert started.attempt is None and not started.owned
    assert await worker_statements.job_heartbeat(conn, worker_id="w1", progress={running_job: 1}) != []
    cur = await conn.execute("SELECT count(*) FROM llm_calls WHERE job_id = %s", (cancelled_job,))
    assert await cur.fetchone() == (1,)
