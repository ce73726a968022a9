"""Every statement that may wait for a lock takes job rows first, in ascending
id order whatever order its caller lists them in, and the shared rate bucket
and ledger rows only after them: two such statements (a worker's heartbeat
and its round, say, on two pooled connections) then queue behind each other
instead of deadlocking. Each test holds a row in another session and checks
what the statement waiting for it already holds."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from shared import store
from shared.ratelimit import RateLimits, claim_params
from shared.rows import Failure
from shared.status import ErrorCode, LlmOutcome
from tests.helpers import client_id_of, enqueue, story_written, wait_until, waiting_on_a_lock

Statement = Callable[[psycopg.AsyncConnection[Any], list[int]], Awaitable[Any]]


def _failure(job_id: int) -> Failure:
    return Failure(job_id=job_id, attempt=1, error_code=ErrorCode.LLM_ERROR, error_text="no",
                   call_outcome=LlmOutcome.FAILED, billed=False)


async def _heartbeat(conn: psycopg.AsyncConnection[Any], ids: list[int]) -> Any:
    return await store.job_heartbeat(conn, worker_id="w1", progress={job_id: 5 for job_id in ids})


async def _settle(conn: psycopg.AsyncConnection[Any], ids: list[int]) -> Any:
    return await store.job_settle_and_claim(conn, worker_id="w1", completions=[story_written(i) for i in ids],
                                            claim_limit=0, provider="offline", model="offline-writer")


async def _fail(conn: psycopg.AsyncConnection[Any], ids: list[int]) -> Any:
    return await store.job_fail_running(conn, worker_id="w1", failures=[_failure(i) for i in ids])


@pytest.mark.parametrize("statement", [_heartbeat, _settle, _fail], ids=["heartbeat", "settle", "fail_running"])
async def test_job_rows_are_locked_in_ascending_id_order(
    database_url: str, conn: psycopg.AsyncConnection[Any], statement: Statement
) -> None:
    client = await client_id_of(conn)
    for n in range(4):
        await enqueue(conn, client, f"story {n}")
    claimed = await store.job_settle_and_claim(conn, worker_id="w1", completions=[], claim_limit=4,
                                               provider="offline", model="offline-writer")
    ids = sorted(job.id for job in claimed.claimed)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as holder, \
            await psycopg.AsyncConnection.connect(database_url, autocommit=True) as actor:
        async with holder.transaction():
            # the highest id is held elsewhere; the statement gets the rows listed highest first
            await holder.execute("SELECT id FROM story_jobs WHERE id = %s FOR UPDATE", (ids[-1],))
            running = asyncio.ensure_future(statement(actor, ids[::-1]))
            await wait_until(lambda: waiting_on_a_lock(conn), what="the statement to wait for the held row")
            # waiting for the highest, it already holds every lower one
            with pytest.raises(psycopg.errors.LockNotAvailable):
                await conn.execute("SELECT id FROM story_jobs WHERE id = ANY(%s) FOR NO KEY UPDATE NOWAIT",
                                   (ids[:-1],))
            await conn.rollback()
        await asyncio.wait_for(running, timeout=10)


async def test_a_limited_round_waiting_for_a_job_row_does_not_hold_the_bucket(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The round with a rate limit locks the model's bucket after the jobs it completes: while it waits
    for one of them, a retry's statement (which holds its job's row, then takes from the bucket) does not
    wait for the bucket, so the three cannot close a cycle."""
    limits = RateLimits(requests_rate=1.0, requests_capacity=5.0, input_tokens_rate=None, input_tokens_capacity=None,
                        output_tokens_rate=None, output_tokens_capacity=None)
    limiter = claim_params(limits, None, default_max_tokens=100)
    await store.llm_rate_bucket_ensure(conn, model="offline-writer", limits=limits)
    client = await client_id_of(conn)
    await enqueue(conn, client, "a fox")
    claimed = await store.job_settle_and_claim(conn, worker_id="w1", completions=[], claim_limit=1,
                                               provider="offline", model="offline-writer", limiter=limiter)
    (job,) = claimed.claimed
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as holder, \
            await psycopg.AsyncConnection.connect(database_url, autocommit=True) as actor:
        async with holder.transaction():
            await holder.execute("SELECT id FROM story_jobs WHERE id = %s FOR UPDATE", (job.id,))
            running = asyncio.ensure_future(store.job_settle_and_claim(
                actor, worker_id="w1", completions=[story_written(job.id)], claim_limit=1,
                provider="offline", model="offline-writer", limiter=limiter))
            await wait_until(lambda: waiting_on_a_lock(conn), what="the round to wait for the held job")
            # raises LockNotAvailable if the waiting round holds the bucket
            await conn.execute("SELECT model FROM llm_rate_buckets WHERE model = 'offline-writer' "
                               "FOR NO KEY UPDATE NOWAIT")
        settled = await asyncio.wait_for(running, timeout=10)
    assert settled.completed_ids == [job.id]


async def test_a_retry_waiting_for_its_job_row_holds_no_ledger_row(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A retry's statement locks its job's row before it closes the previous attempt's ledger row: while
    it waits for the job (held by a cancellation or a sweep, whose next statement closes that ledger
    row), it holds no ledger row, so the two cannot deadlock."""
    client = await client_id_of(conn)
    await enqueue(conn, client, "a fox")
    claimed = await store.job_settle_and_claim(conn, worker_id="w1", completions=[], claim_limit=1,
                                               provider="offline", model="offline-writer")
    (job,) = claimed.claimed
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as holder, \
            await psycopg.AsyncConnection.connect(database_url, autocommit=True) as actor:
        async with holder.transaction():
            await holder.execute("SELECT id FROM story_jobs WHERE id = %s FOR UPDATE", (job.id,))
            running = asyncio.ensure_future(store.llm_call_start(
                actor, worker_id="w1", job_id=job.id, previous_attempt=1, previous_outcome=LlmOutcome.FAILED,
                previous_billed=False, previous_error="529", model="offline-writer"))
            await wait_until(lambda: waiting_on_a_lock(conn), what="the retry to wait for the held job")
            # raises LockNotAvailable if the waiting retry holds the ledger row
            await conn.execute("SELECT job_id FROM llm_calls WHERE job_id = %s FOR NO KEY UPDATE NOWAIT", (job.id,))
        started = await asyncio.wait_for(running, timeout=10)
    assert started.attempt == 2


async def test_closing_a_stopped_stream_waiting_for_its_job_row_holds_no_ledger_row(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Closing the call of a stream stopped because its job was cancelled locks the job's row before
    the ledger row, like every other statement that writes both."""
    client = await client_id_of(conn)
    job_id = await enqueue(conn, client, "a fox")
    claimed = await store.job_settle_and_claim(conn, worker_id="w1", completions=[], claim_limit=1,
                                               provider="offline", model="offline-writer")
    (job,) = claimed.claimed
    cancelled = await store.job_cancel(conn, client_id=client, job_id=job_id)
    assert cancelled is not None and cancelled.cancelled
    # the worst case a budget's reservation would have charged it, which the close brings down
    await conn.execute("UPDATE story_jobs SET charged_usd = 0.04 WHERE id = %s", (job.id,))
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as holder, \
            await psycopg.AsyncConnection.connect(database_url, autocommit=True) as actor:
        async with holder.transaction():
            await holder.execute("SELECT id FROM story_jobs WHERE id = %s FOR UPDATE", (job.id,))
            running = asyncio.ensure_future(store.llm_call_finish(
                actor, job_id=job.id, attempt=1, outcome=LlmOutcome.SUCCEEDED, billed=True, input_tokens=1,
                output_tokens=2, cost_usd=Decimal("0.001"), error_text=None))
            await wait_until(lambda: waiting_on_a_lock(conn), what="the close to wait for the held job")
            # raises LockNotAvailable if the waiting close holds the ledger row
            await conn.execute("SELECT job_id FROM llm_calls WHERE job_id = %s FOR NO KEY UPDATE NOWAIT", (job.id,))
        await asyncio.wait_for(running, timeout=10)
    cur = await conn.execute("SELECT c.outcome::text, c.billed, j.charged_usd FROM llm_calls c "
                             "JOIN story_jobs j ON j.id = c.job_id WHERE c.job_id = %s", (job.id,))
    assert await cur.fetchall() == [("succeeded", True, Decimal("0.001"))]
