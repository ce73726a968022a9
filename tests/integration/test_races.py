"""Races between actors on one job, forced deterministically with row locks."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import MutableMapping, Sequence
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from shared.ratelimit import RateLimits
from shared.status import ErrorCode, LlmOutcome
from sweeper.store import PgSweeperStore
from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer, Plan
from tests.support import worker_statements
from tests.support.database import (
    client_id_of,
    count,
    enqueue,
    job_rows,
    story_written,
    waiting_on_a_lock,
)
from tests.support.settings import LATER, SWEEP, worker_settings
from tests.support.waiting import wait_until
from tests.support.workers import running_worker
from worker.anthropic_writer import AnthropicWriter
from worker.pg_store import PgWorkerStore
from worker.rows import Completion
from worker.store import ClaimAsk, RoundWritten


async def _claim_one(conn: psycopg.AsyncConnection[Any], worker_id: str) -> int:
    result = await worker_statements.job_claim(conn, worker_id=worker_id, claim_limit=1,
                                              provider="offline", model="offline-writer")
    assert len(result.claimed) == 1
    return result.claimed[0].id


async def test_completion_first_sweeper_changes_nothing(database_url: str, conn: psycopg.AsyncConnection[Any]) -> None:
    """Ordering A: a completion holds the row while the sweeper passes; the job ends completed."""
    client = await client_id_of(conn)
    await enqueue(conn, client, "a fox")
    claimed = await worker_statements.job_claim(conn, worker_id="w1", claim_limit=1,
                                               provider="offline", model="offline-writer")
    job = claimed.claimed[0]
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as worker_conn:
        async with worker_conn.transaction():
            settled = await worker_statements.job_settle(worker_conn, worker_id="w1", completions=[story_written(job.id)])
            assert settled.completed_ids == [job.id]
            # the completion is not committed yet and holds the row: the sweeper
            # (with a clock two hours ahead, so the job looks dead) skips it
            assert await PgSweeperStore(conn).fail_stale(now=LATER, **SWEEP) == []
        # committed: a later pass finds a finished job and changes nothing either
        assert await PgSweeperStore(conn).fail_stale(now=LATER, **SWEEP) == []
    (row,) = await job_rows(conn)
    assert row.status == "completed" and row.story_id is not None


async def test_sweeper_first_completion_loses_and_story_is_orphaned(
    database_url: str, conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool
) -> None:
    """Ordering B: the sweeper fails the job while its story is being saved; the job stays failed,
    the paid-for story is kept, and the worker logs `sweeper raced, story orphaned`."""
    client = await client_id_of(conn)
    hold = threading.Event()
    fake = FakeAnthropic(default=Plan(hold=hold))
    settings = worker_settings(anthropic_api_key="test", heartbeat_interval_s=30, heartbeat_timeout_s=120)
    with FakeAnthropicServer(fake) as server, capture_logs() as logs:
        writer = AnthropicWriter(worker_settings(anthropic_api_key="test", anthropic_base_url=server.base_url))
        async with running_worker(settings, pool, writer, listen_url=database_url):
            job_id = await enqueue(conn, client, "a dragon who cannot sleep")
            await asyncio.to_thread(fake.wait_for, lambda f: len(f.calls) == 1)
            sweeper_conn = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
            async with sweeper_conn, sweeper_conn.transaction():
                swept = await PgSweeperStore(sweeper_conn).fail_stale(now=LATER, **SWEEP)
                assert [s.public_id for s in swept] == [job_id]
                hold.set()  # the story finishes; its completion now waits for our row lock
                await wait_until(lambda: waiting_on_a_lock(conn), what="the completion to block")
            # committed: the blocked completion re-checks status = 'running' and finds 'failed'
            await wait_until(lambda: _has_event(logs, "job.lost_race"), what="the lost race to be logged")
        await writer.aclose()
    (row,) = await job_rows(conn)
    assert row.status == "failed" and row.error_code == "timed_out" and row.story_id is None
    assert await count(conn, "SELECT count(*) FROM stories WHERE job_id = %s", row.id) == 1
    (event,) = [e for e in logs if e["event"] == "job.lost_race"]
    assert event["detail"] == "sweeper raced, story orphaned"
    assert event["job_id"] == str(job_id)
    assert len(fake.billed) == 1


async def _has_event(logs: list[MutableMapping[str, Any]], name: str) -> bool:
    return any(e["event"] == name for e in logs)


async def test_many_claimers_claim_every_row_exactly_once(database_url: str, conn: psycopg.AsyncConnection[Any]) -> None:
    """16 concurrent claimers on 200 pending rows: every row is claimed exactly once, with one ledger row."""
    client = await client_id_of(conn)
    for n in range(200):
        await enqueue(conn, client, f"story {n}")

    async def claimer(number: int) -> list[int]:
        mine: list[int] = []
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            while True:
                result = await worker_statements.job_claim(
                    c, worker_id=f"claimer-{number}", claim_limit=1 + number % 3,
                    provider="offline", model="offline-writer")
                if not result.claimed:
                    return mine
                mine.extend(job.id for job in result.claimed)

    claims = await asyncio.gather(*(claimer(n) for n in range(16)))
    every = [job_id for mine in claims for job_id in mine]
    assert len(every) == 200 and len(set(every)) == 200
    assert sum(1 for mine in claims if mine) > 1  # they really competed
    rows = await job_rows(conn)
    assert {r.status for r in rows} == {"running"}
    # each job's owner is the claimer that got it
    owner = {job_id: f"claimer-{n}" for n, mine in enumerate(claims) for job_id in mine}
    assert all(r.worker_id == owner[r.id] for r in rows)
    assert await count(conn, "SELECT count(*) FROM llm_calls WHERE attempt = 1") == 200


async def test_guarded_completion_by_another_worker_changes_nothing(conn: psycopg.AsyncConnection[Any]) -> None:
    """A completion from a worker that does not own the job is a lost race: the job stays as it was."""
    client = await client_id_of(conn)
    await enqueue(conn, client, "a fox")
    job_id = await _claim_one(conn, "owner")
    result = await worker_statements.job_settle(conn, worker_id="intruder", completions=[story_written(job_id)])
    assert result.completed_ids == [] and result.already_completed_ids == []
    (row,) = await job_rows(conn)
    assert row.status == "running" and row.worker_id == "owner"


async def test_retried_completion_after_ambiguous_commit_is_recognised(conn: psycopg.AsyncConnection[Any]) -> None:
    """Sending the same completion twice (its first answer lost) neither fails nor duplicates the story, and
    the job still names the story stored (the retry makes an id of its own for a story it does not insert)."""
    client = await client_id_of(conn)
    await enqueue(conn, client, "a fox")
    job_id = await _claim_one(conn, "w1")
    done = [story_written(job_id)]
    first = await worker_statements.job_settle(conn, worker_id="w1", completions=done)
    again = await worker_statements.job_settle(conn, worker_id="w1", completions=done)
    assert first.completed_ids == [job_id]
    assert again.completed_ids == [] and again.already_completed_ids == [job_id]
    assert await count(conn, "SELECT count(*) FROM stories") == 1
    assert await count(conn, "SELECT count(*) FROM story_jobs j JOIN stories s ON s.id = j.story_id "
                             "AND s.job_id = j.id") == 1


@pytest.mark.parametrize("status", ["completed", "failed"])
async def test_sweeper_never_touches_a_finished_job(conn: psycopg.AsyncConnection[Any], status: str) -> None:
    """A finished job is left alone by the sweeper however old it is."""
    client = await client_id_of(conn)
    await enqueue(conn, client, "a fox")
    job_id = await _claim_one(conn, "w1")
    if status == "completed":
        await worker_statements.job_settle(conn, worker_id="w1", completions=[story_written(job_id)])
    else:
        from worker.rows import Failure

        await worker_statements.job_fail_running(conn, worker_id="w1", failures=[Failure(
            job_id=job_id, attempt=1, error_code=ErrorCode.LLM_ERROR, error_text="x",
            call_outcome=LlmOutcome.FAILED, billed=True)])
    assert await PgSweeperStore(conn).fail_stale(now=LATER + timedelta(days=30), **SWEEP) == []
    (row,) = await job_rows(conn)
    assert row.status == status


class AnswerLosingStore(PgWorkerStore):
    """The real store, except that the answer of its first claim is lost after
    the claim committed, as when the connection drops around the commit."""

    answers_lost = 0

    async def settle_and_claim(self, completions: Sequence[Completion], ask: ClaimAsk | None,
                               limits: RateLimits) -> RoundWritten:
        written = await super().settle_and_claim(completions, ask, limits)
        if ask is not None and ask.limit and not self.answers_lost:
            self.answers_lost += 1
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return written


@pytest.mark.parametrize("stop_first", [False, True], ids=["running", "stopping"])
async def test_a_claim_whose_answer_was_lost_is_run_by_its_worker_once(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, stop_first: bool
) -> None:
    """A claim that committed but whose answer never reached the worker leaves a job running under the
    worker's id: the worker adopts it at its next round, also when it is stopping, and writes its story,
    with one ledger row and nothing claimed twice."""
    from worker.coordinator import Coordinator
    from worker.offline import OfflineWriter

    client = await client_id_of(conn)
    await enqueue(conn, client, "a story claimed in the dark")
    writer = OfflineWriter(0)
    store_ = AnswerLosingStore(pool, worker_id="w-lost", provider=writer.provider, model=writer.model,
                               default_max_tokens=4000)
    worker = Coordinator(worker_settings(), store_, writer, listen=False)
    lost = await worker.round_once()
    assert lost.database_error is not None and lost.claimed == 0
    if stop_first:
        worker.stop()
    assert (await worker.round_once()).adopted == 1
    task = asyncio.create_task(worker.run())
    await wait_until(lambda: _completed(conn), what="the adopted job to complete")
    worker.stop()
    assert await asyncio.wait_for(task, 30), "the worker left jobs unrecorded"
    (row,) = await job_rows(conn)
    assert row.status == "completed" and row.worker_id == "w-lost"
    assert await count(conn, "SELECT count(*) FROM llm_calls") == 1
    assert await count(conn, "SELECT count(*) FROM llm_calls WHERE outcome = 'succeeded'") == 1


async def _completed(conn: psycopg.AsyncConnection[Any]) -> bool:
    return await count(conn, "SELECT count(*) FROM story_jobs WHERE status = 'completed'") == 1
