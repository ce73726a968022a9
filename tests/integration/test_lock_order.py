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

from api.store import ApiStore
from shared.ratelimit import NO_LIMITS, RateLimits
from shared.status import ErrorCode, LlmOutcome
from tests.support import worker_statements
from tests.support.database import client_id_of, count, enqueue, story_written, waiting_on_a_lock
from tests.support.money import money_problems
from tests.support.waiting import wait_until
from worker.rows import ClaimedJob, DraftPiece, Failure

Conn = psycopg.AsyncConnection[Any]
Statement = Callable[[Conn, list[int]], Awaitable[Any]]


async def _running_jobs(conn: Conn, count: int, limits: RateLimits = NO_LIMITS) -> list[ClaimedJob]:
    """count jobs, enqueued and claimed by worker w1, in id order."""
    client = await client_id_of(conn)
    for n in range(count):
        await enqueue(conn, client, f"story {n}")
    claimed = await worker_statements.job_claim(conn, worker_id="w1", claim_limit=count,
                                               provider="offline", model="offline-writer", limits=limits,
                                                default_max_tokens=100)
    assert len(claimed.claimed) == count
    return sorted(claimed.claimed, key=lambda job: job.id)


async def _while_waiting_for_job(
    database_url: str, conn: Conn, job_id: int, statement: Callable[[Conn], Awaitable[Any]],
    check: Callable[[], Awaitable[None]],
) -> Any:
    """Holds job_id's row in one session, starts statement in another, runs
    check (on conn) once the statement waits for that row, then lets it go on;
    returns what the statement answered."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as holder, \
            await psycopg.AsyncConnection.connect(database_url, autocommit=True) as actor:
        async with holder.transaction():
            await holder.execute("SELECT id FROM story_jobs WHERE id = %s FOR UPDATE", (job_id,))
            running = asyncio.ensure_future(statement(actor))
            await wait_until(lambda: waiting_on_a_lock(conn), what="the statement to wait for the held job")
            await check()
        return await asyncio.wait_for(running, timeout=10)


def _failure(job_id: int) -> Failure:
    return Failure(job_id=job_id, attempt=1, error_code=ErrorCode.LLM_ERROR, error_text="no",
                   call_outcome=LlmOutcome.FAILED, billed=False)


async def _heartbeat(conn: Conn, ids: list[int]) -> Any:
    return await worker_statements.job_heartbeat(conn, worker_id="w1", progress={job_id: 5 for job_id in ids})


async def _settle(conn: Conn, ids: list[int]) -> Any:
    return await worker_statements.job_settle(conn, worker_id="w1", completions=[story_written(i) for i in ids])


async def _fail(conn: Conn, ids: list[int]) -> Any:
    return await worker_statements.job_fail_running(conn, worker_id="w1", failures=[_failure(i) for i in ids])


@pytest.mark.parametrize("statement", [_heartbeat, _settle, _fail], ids=["heartbeat", "settle", "fail_running"])
async def test_job_rows_are_locked_in_ascending_id_order(
    database_url: str, conn: Conn, statement: Statement
) -> None:
    ids = [job.id for job in await _running_jobs(conn, 4)]

    async def every_lower_job_held() -> None:
        with pytest.raises(psycopg.errors.LockNotAvailable):
            await conn.execute("SELECT id FROM story_jobs WHERE id = ANY(%s) FOR NO KEY UPDATE NOWAIT",
                               (ids[:-1],))

    # the highest id is held elsewhere and the statement gets the rows listed highest first:
    # waiting for the highest, it already holds every lower one
    await _while_waiting_for_job(database_url, conn, ids[-1], lambda actor: statement(actor, ids[::-1]),
                                 every_lower_job_held)


async def _ledger_row_free(conn: Conn, job_id: int) -> None:
    """Raises LockNotAvailable if some session holds job_id's ledger row."""
    await conn.execute("SELECT job_id FROM llm_calls WHERE job_id = %s FOR NO KEY UPDATE NOWAIT", (job_id,))


async def test_a_limited_settle_waiting_for_a_job_row_does_not_hold_the_bucket(database_url: str, conn: Conn) -> None:
    """The settle with a rate limit locks the model's bucket after the jobs it completes: while it waits
    for one of them, a retry's statement (which holds its job's row, then takes from the bucket) does not
    wait for the bucket, so the three cannot close a cycle."""
    limits = RateLimits(requests_rate=1.0, requests_capacity=5.0, input_tokens_rate=None, input_tokens_capacity=None,
                        output_tokens_rate=None, output_tokens_capacity=None)
    await worker_statements.llm_rate_bucket_ensure(conn, model="offline-writer", limits=limits)
    (job,) = await _running_jobs(conn, 1, limits)

    async def bucket_free() -> None:
        await conn.execute("SELECT model FROM llm_rate_buckets WHERE model = 'offline-writer' "
                           "FOR NO KEY UPDATE NOWAIT")

    settled = await _while_waiting_for_job(
        database_url, conn, job.id,
        lambda actor: worker_statements.job_settle(actor, worker_id="w1", completions=[story_written(job.id)],
                                              model="offline-writer", limits=limits),
        bucket_free)
    assert settled.completed_ids == [job.id]


async def test_a_retry_waiting_for_its_job_row_holds_no_ledger_row(database_url: str, conn: Conn) -> None:
    """A retry's statement locks its job's row before it closes the previous attempt's ledger row: while
    it waits for the job (held by a cancellation or a sweep, whose next statement closes that ledger
    row), it holds no ledger row, so the two cannot deadlock."""
    (job,) = await _running_jobs(conn, 1)
    started = await _while_waiting_for_job(
        database_url, conn, job.id,
        lambda actor: worker_statements.llm_call_start(actor, worker_id="w1", job_id=job.id, previous_attempt=1,
                                           previous_outcome=LlmOutcome.OVERLOADED, previous_error="529", model="offline-writer"),
        lambda: _ledger_row_free(conn, job.id))
    assert started.attempt == 2


async def test_closing_a_stopped_stream_waiting_for_its_job_row_holds_no_ledger_row(
    database_url: str, conn: Conn
) -> None:
    """Closing the call of a stream stopped because its job was cancelled locks the job's row before
    the ledger row, like every other statement that writes both."""
    (job,) = await _running_jobs(conn, 1)
    cancelled = await ApiStore(conn).job_cancel(client_id=job.client_id, job_id=job.public_id)
    assert cancelled is not None and cancelled.cancelled
    await _while_waiting_for_job(
        database_url, conn, job.id,
        lambda actor: worker_statements.llm_call_finish(actor, model="m", job_id=job.id, attempt=1, outcome=LlmOutcome.SUCCEEDED,
                                            billed=True, input_tokens=1, output_tokens=2,
                                            cost_usd=Decimal("0.001"), error_text=None),
        lambda: _ledger_row_free(conn, job.id))
    cur = await conn.execute("SELECT c.outcome::text, c.billed, j.charged_usd FROM llm_calls c "
                             "JOIN story_jobs j ON j.id = c.job_id WHERE c.job_id = %s", (job.id,))
    assert await cur.fetchall() == [("succeeded", True, Decimal("0.001"))]


async def _fail_billed(conn: Conn, ids: list[int]) -> Any:
    return await worker_statements.job_fail_running(conn, worker_id="w1", failures=[
        Failure(job_id=job_id, attempt=1, error_code=ErrorCode.LLM_ERROR, error_text="the stream broke",
                call_outcome=LlmOutcome.FAILED, billed=True, input_tokens=1, output_tokens=2,
                cost_usd=story_written(job_id).cost_usd)
        for job_id in ids])


@pytest.mark.parametrize("statement", [_settle, _fail_billed], ids=["settle", "fail_running"])
async def test_an_end_takes_a_job_cancelled_meanwhile_in_id_order_with_the_rest(
    database_url: str, conn: Conn, statement: Statement
) -> None:
    """A worker's end of two jobs whose lower one its client cancelled mid-call: closing that call moves the
    cancelled job's charge, so the end writes its row too (the ledger's trigger). Another session holds that
    row, as a draft write whose recheck found the job cancelled keeps it; the end waits for it before it takes
    the higher job, so the draft write then gets the higher one, and nothing deadlocks (jobs_end, migration
    033). The end then ends the higher job with its draft, and both are charged what their calls billed."""
    lower, higher = await _running_jobs(conn, 2)
    cancelled = await ApiStore(conn).job_cancel(client_id=lower.client_id, job_id=lower.public_id)
    assert cancelled is not None and cancelled.cancelled
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as drafts, \
            await psycopg.AsyncConnection.connect(database_url, autocommit=True) as actor:
        async with drafts.transaction():
            await drafts.execute("SELECT id FROM story_jobs WHERE id = %s FOR SHARE", (lower.id,))
            ending = asyncio.ensure_future(statement(actor, [lower.id, higher.id]))
            await wait_until(lambda: waiting_on_a_lock(conn), what="the end to wait for the cancelled job")
            written = await worker_statements.draft_append(drafts, worker_id="w1",
                                                           pieces=[DraftPiece(higher.id, 0, "Once")])
        ended = await asyncio.wait_for(ending, timeout=10)
    assert written == {higher.id: 4}
    assert (ended.completed_ids if statement is _settle else ended) == [higher.id]
    cur = await conn.execute("SELECT id, status::text, error_code::text, charged_usd FROM story_jobs ORDER BY id")
    assert await cur.fetchall() == [
        (lower.id, "failed", "cancelled", story_written(lower.id).cost_usd),
        (higher.id, "completed" if statement is _settle else "failed", None if statement is _settle else "llm_error",
         story_written(higher.id).cost_usd)]
    assert await count(conn, "SELECT count(*) FROM story_draft_chunks") == 0
    assert await money_problems(conn) == []
