"""The sweeper's pass: its three rules, its counts, and its caution after an outage."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from shared.config import SweeperSettings
from shared.config_load import load
from shared.store import job_admission_lock
from sweeper.rows import LedgerPruned
from sweeper.store import PgSweeperStore
from sweeper.sweep import Sweeper
from tests.support import worker_statements
from tests.support.database import (
    claim_floor,
    client_id_of,
    count,
    enqueue,
    enqueue_batch,
    job_rows,
    pages_read,
    waiting_on_a_lock,
)
from tests.support.settings import sweeper_settings
from tests.support.waiting import wait_until


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _claim(conn: psycopg.AsyncConnection[Any], n: int = 1) -> None:
    result = await worker_statements.job_claim(conn, worker_id="w1", claim_limit=n,
                                              provider="offline", model="offline-writer")
    assert len(result.claimed) == n


async def _db_now(conn: psycopg.AsyncConnection[Any]) -> datetime:
    cur = await conn.execute("SELECT now()")
    row = await cur.fetchone()
    assert row is not None
    now: datetime = row[0]
    return now


async def _judging_sweeper(conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, *, jobs: int,
                           claimed: int) -> Sweeper:
    """``jobs`` jobs enqueued and ``claimed`` of them claimed, and a sweeper (HEARTBEAT_TIMEOUT_S 60) that has
    seen the database writable for a heartbeat timeout: it judges running jobs."""
    client = await client_id_of(conn)
    for n in range(jobs):
        await enqueue(conn, client, f"story {n}")
    await _claim(conn, claimed)
    clock = FakeClock()
    sweeper = Sweeper(sweeper_settings(heartbeat_timeout_s=60), PgSweeperStore(pool), clock=clock)
    await sweeper.probe()
    clock.now += 61
    return sweeper


async def test_each_rule_fails_its_jobs_with_its_reason(conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool) -> None:
    """A dead heartbeat is interrupted, an over-long run timed_out, an over-long wait queue_timeout."""
    client = await client_id_of(conn)
    for n in range(3):
        await enqueue(conn, client, f"story {n}")
    await _claim(conn, 2)
    # job 1 ran for too long; job 2 only stopped beating; job 3 waited too long
    await conn.execute("UPDATE story_jobs SET started_at = now() - interval '1 hour' WHERE id = 1")
    await conn.execute("UPDATE story_jobs SET heartbeat_at = now() - interval '5 minutes' WHERE id = 2")
    await conn.execute("UPDATE story_jobs SET created_at = now() - interval '1 day' WHERE id = 3")
    clock = FakeClock()
    sweeper = Sweeper(sweeper_settings(heartbeat_timeout_s=60, job_timeout_s=480, pending_timeout_s=1800),
                      PgSweeperStore(pool), clock=clock)
    await sweeper.probe()
    clock.now += 61
    with capture_logs() as logs:
        result = await sweeper.sweep_once()
    assert (result.timed_out, result.interrupted, result.queue_timeout) == (1, 1, 1)
    assert [(r.status, r.error_code) for r in await job_rows(conn)] == [
        ("failed", "timed_out"), ("failed", "interrupted"), ("failed", "queue_timeout")]
    assert sorted(e["reason"] for e in logs if e["event"] == "sweeper.reclaimed") == [
        "interrupted", "queue_timeout", "timed_out"]
    # a second pass finds nothing left to do
    assert (await sweeper.sweep_once()).reclaimed == 0


async def test_live_jobs_are_left_alone(conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool) -> None:
    """Fresh pending and running jobs are not touched, and the gauges count them."""
    sweeper = await _judging_sweeper(conn, pool, jobs=3, claimed=1)
    result = await sweeper.sweep_once()
    assert result.reclaimed == 0 and (result.pending, result.running) == (2, 1)
    assert result.oldest_pending_age_seconds >= 0


async def test_heartbeats_are_not_judged_until_connected_for_a_heartbeat_timeout(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool
) -> None:
    """After (re)connecting, the sweeper waits a whole HEARTBEAT_TIMEOUT_S before it fails a job for a
    stale heartbeat, so that workers cut off by the same outage are not declared dead."""
    client = await client_id_of(conn)
    await enqueue(conn, client, "a fox")
    await _claim(conn)
    await conn.execute("UPDATE story_jobs SET heartbeat_at = now() - interval '5 minutes'")
    clock = FakeClock()
    sweeper = Sweeper(sweeper_settings(heartbeat_timeout_s=60), PgSweeperStore(pool), clock=clock)
    first = await sweeper.sweep_once()
    assert not first.judged_running and first.reclaimed == 0
    clock.now += 59
    assert (await sweeper.sweep_once()).reclaimed == 0
    # an outage: the wait starts again from the reconnection
    sweeper.connection_lost()
    clock.now += 30
    assert (await sweeper.sweep_once()).reclaimed == 0
    clock.now += 59
    assert (await sweeper.sweep_once()).reclaimed == 0
    clock.now += 2
    result = await sweeper.sweep_once()
    assert result.judged_running and result.interrupted == 1


async def test_the_admission_lock_held_past_a_heartbeat_interval_is_no_outage(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
) -> None:
    """A bulk cancel holds the admission lock longer than the lock timeout the floor's advance waits for. That
    says nothing of heartbeats: the pass still ends, the floor stays where it was, and running jobs go on being
    judged, so a job whose worker died is failed at the next pass rather than a heartbeat timeout later."""
    sweeper = await _judging_sweeper(conn, pool, jobs=3, claimed=2)
    floor = await claim_floor(conn)
    async with await psycopg.AsyncConnection.connect(database_url) as cancelling:
        await job_admission_lock(cancelling)
        with capture_logs() as logs:
            held = await sweeper.sweep_once()
        await conn.execute("UPDATE story_jobs SET heartbeat_at = now() - interval '5 minutes' WHERE id = 1")
        after = await sweeper.sweep_once()
        await cancelling.rollback()
    assert held.judged_running and after.judged_running and after.interrupted == 1
    assert [e["event"] for e in logs if e["log_level"] in ("warning", "error")] == ["sweeper.claim_floor_lock_waited"]
    assert await claim_floor(conn) == floor
    await sweeper.sweep_once()
    assert await claim_floor(conn) > floor


async def test_finished_jobs_are_pruned_after_retention(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool
) -> None:
    """Jobs finished longer ago than JOB_RETENTION_S are deleted with their keys; younger and live ones
    stay; the ledger stays."""
    client = await client_id_of(conn)
    for n in range(4):
        await enqueue(conn, client, f"story {n}")
    await _claim(conn, 3)
    await conn.execute("UPDATE story_jobs SET status = 'failed', error_code = 'cancelled', completed_at = now() "
                       "WHERE id IN (1, 2)")
    await conn.execute("UPDATE story_jobs SET created_at = now() - interval '40 days', completed_at = now() - interval '40 days' "
                       "WHERE id = 1")
    sweeper = Sweeper(sweeper_settings(job_retention_s=30 * 24 * 3600), PgSweeperStore(pool), clock=FakeClock())
    result = await sweeper.sweep_once()
    assert result.pruned == 1
    assert [r.id for r in await job_rows(conn)] == [2, 3, 4]
    cur = await conn.execute("SELECT count(*) FROM llm_calls")
    assert await cur.fetchone() == (3,)
    # the pruned job's Idempotency-Key is free again; the others still name their jobs
    cur = await conn.execute("SELECT job_id FROM job_idempotency_keys ORDER BY job_id")
    assert [row[0] for row in await cur.fetchall()] == [2, 3, 4]


async def test_the_ledger_is_kept_unless_its_own_retention_is_set_then_only_rows_of_gone_jobs_go(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool
) -> None:
    """Four calls started 40 days ago or 20: LEDGER_RETENTION_S unset keeps them all. Set to 30 days, a pass
    deletes the one whose job it pruned and whose call is old; it keeps a batch request's row (its batch's
    record), the young call's, and that of a job still kept."""
    client = await client_id_of(conn)
    for n in range(4):
        await enqueue(conn, client, f"story {n}")
    await _claim(conn, 4)
    await conn.execute("UPDATE story_jobs SET status = 'failed', error_code = 'cancelled', completed_at = now()")
    await conn.execute("UPDATE story_jobs SET created_at = now() - interval '40 days', "
                       "completed_at = now() - interval '40 days' WHERE id IN (1, 2, 3)")
    await conn.execute("UPDATE llm_calls SET started_at = now() - interval '40 days' WHERE job_id IN (1, 2, 4)")
    await conn.execute("UPDATE llm_calls SET started_at = now() - interval '20 days' WHERE job_id = 3")
    await conn.execute("UPDATE llm_calls SET batch_id = 7 WHERE job_id = 2")
    month = 30 * 24 * 3600.0
    kept = await Sweeper(sweeper_settings(job_retention_s=month), PgSweeperStore(pool),
                         clock=FakeClock()).sweep_once()
    assert (kept.pruned, kept.ledger_pruned) == (3, 0)
    assert await _ledger_jobs(conn) == [1, 2, 3, 4]
    with capture_logs() as logs:
        result = await Sweeper(sweeper_settings(job_retention_s=month, ledger_retention_s=month),
                               PgSweeperStore(pool), clock=FakeClock()).sweep_once()
    assert result.ledger_pruned == 1
    assert await _ledger_jobs(conn) == [2, 3, 4]
    assert [e["ledger_pruned"] for e in logs if e["event"] == "sweeper.pass"] == [1]


async def test_the_ledgers_prune_walks_past_no_batch_request(conn: psycopg.AsyncConnection[Any]) -> None:
    """Batch requests' rows are kept for good: however many there are, a prune that finds nothing to delete
    reads a few pages, not them."""
    await conn.execute(
        "INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model, started_at, batch_id) "
        "SELECT n, 1, 'batch', 'anthropic', 'm', now() - interval '40 days', 1 FROM generate_series(1, 5000) n")
    params = {"retention_s": 30 * 24 * 3600.0, "batch_size": 500, "now": None, "after": None}
    assert await pages_read(conn, "ledger_prune", params) <= 5
    assert await count(conn, "SELECT count(*) FROM llm_calls") == 5000


async def test_the_ledgers_prune_takes_each_call_started_past_the_retention_a_batch_at_a_time(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """Calls of gone jobs, by the clock the statement is given: one started exactly the retention before it
    stays, a microsecond more and it goes; a batch deletes at most its size; a job's later attempt, younger
    than the retention, stays when its first goes."""
    day = timedelta(days=1)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    await conn.execute(
        "INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model, started_at) VALUES "
        "(1, 1, 'w', 'anthropic', 'm', %(start)s), (2, 1, 'w', 'anthropic', 'm', %(start)s), "
        "(3, 1, 'w', 'anthropic', 'm', %(start)s), (3, 2, 'w', 'anthropic', 'm', %(later)s)",
        {"start": start, "later": start + 5 * day})
    store = PgSweeperStore(conn)
    month = 30 * 24 * 3600.0
    at_the_retention = start + 30 * day
    assert await store.prune_ledger(retention_s=month, batch_size=10, now=at_the_retention) == LedgerPruned(0, None)
    past = at_the_retention + timedelta(microseconds=1)
    assert await store.prune_ledger(retention_s=month, batch_size=2, now=past) == LedgerPruned(2, start)
    assert await store.prune_ledger(retention_s=month, batch_size=2, now=past) == LedgerPruned(1, start)
    cur = await conn.execute("SELECT job_id, attempt FROM llm_calls")
    assert await cur.fetchall() == [(3, 2)]


async def test_behind_jobs_still_kept_the_ledgers_prune_reads_four_batches_and_waits(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """A sweeper stopped for days leaves old jobs unpruned, their calls first in the walk. A statement reads at
    most four batches' worth of the oldest calls and deletes the gone jobs' among them: behind seven kept calls,
    a batch of two reads eight and deletes the one gone job's call among them; one of three reads twelve."""
    client = await client_id_of(conn)
    for n in range(7):
        await enqueue(conn, client, f"story {n}")
    await _claim(conn, 7)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    await conn.execute("UPDATE llm_calls SET started_at = %(start)s + job_id * interval '1 second'",
                       {"start": start})
    await conn.execute(
        "INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model, started_at) "
        "SELECT 1000 + n, 1, 'w', 'anthropic', 'm', %(later)s FROM generate_series(1, 6) n",
        {"later": start + timedelta(days=1)})
    store = PgSweeperStore(conn)
    month, now = 30 * 24 * 3600.0, start + timedelta(days=40)
    assert (await store.prune_ledger(retention_s=month, batch_size=2, now=now)).deleted == 1
    assert (await store.prune_ledger(retention_s=month, batch_size=3, now=now)).deleted == 3
    assert await count(conn, "SELECT count(*) FROM llm_calls WHERE job_id > 1000") == 2
    assert await count(conn, "SELECT count(*) FROM llm_calls WHERE job_id <= 7") == 7


async def _ledger_jobs(conn: psycopg.AsyncConnection[Any]) -> list[int]:
    cur = await conn.execute("SELECT job_id FROM llm_calls ORDER BY job_id")
    return [row[0] for row in await cur.fetchall()]


async def test_the_prune_frees_each_pruned_jobs_key_of_its_own_client_only(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool
) -> None:
    """Two clients use the same two Idempotency-Keys; of the four jobs, one of each client's expires, under a
    different key: the prune frees those two keys, each for its own client, and no other pairing of them."""
    first, second = await client_id_of(conn, "first"), await client_id_of(conn, "second")
    for client, key in ((first, "x"), (second, "y"), (first, "y"), (second, "x")):
        await enqueue(conn, client, f"story {key}", key=key)
    await conn.execute("UPDATE story_jobs SET status = 'failed', error_code = 'cancelled', "
                       "completed_at = now() - CASE WHEN id <= 2 THEN interval '40 days' ELSE interval '1 day' END, "
                       "created_at = now() - CASE WHEN id <= 2 THEN interval '40 days' ELSE interval '1 day' END")
    sweeper = Sweeper(sweeper_settings(job_retention_s=30 * 24 * 3600), PgSweeperStore(pool), clock=FakeClock())
    assert (await sweeper.sweep_once()).pruned == 2
    cur = await conn.execute("SELECT client_id, idempotency_key, job_id FROM job_idempotency_keys ORDER BY job_id")
    assert await cur.fetchall() == [(first, "y", 3), (second, "x", 4)]


async def test_a_job_is_pruned_by_when_it_finished_not_by_when_it_was_made(conn: psycopg.AsyncConnection[Any]) -> None:
    """Three jobs made 40 days ago, finished 29 days ago, exactly 30 days ago and 31 days ago: with a retention
    of 30 days only the last is pruned. The walk ends above them (and below a job made now), where
    prune_below_id says."""
    client = await client_id_of(conn)
    for n in range(4):
        await enqueue(conn, client, f"story {n}")
    now = await _db_now(conn)
    for job_id, finished_days_ago in ((1, 29), (2, 30), (3, 31)):
        await conn.execute("UPDATE story_jobs SET status = 'failed', error_code = 'cancelled', "
                           "created_at = %(now)s - interval '40 days', "
                           "completed_at = %(now)s - make_interval(days => %(days)s) WHERE id = %(id)s",
                           {"now": now, "days": finished_days_ago, "id": job_id})
    store = PgSweeperStore(conn)
    assert 3 < await store.prune_below_id(retention_s=30 * 86400, now=now) <= 4
    assert [job.id for job in await store.prune_finished(retention_s=30 * 86400, batch_size=10, now=now)] == [3]


async def test_a_batch_job_is_kept_while_its_requests_result_is_unread(conn: psycopg.AsyncConnection[Any]) -> None:
    """Two batch jobs finished 40 days ago in one ended batch: the one whose request's result is still to be
    read stays, the one whose result was read is pruned."""
    client = await client_id_of(conn)
    for n in range(2):
        await enqueue(conn, client, f"story {n}")
    await conn.execute("UPDATE story_jobs SET status = 'failed', error_code = 'cancelled', "
                       "created_at = now() - interval '40 days', completed_at = now() - interval '40 days'")
    await conn.execute("INSERT INTO message_batches (state, provider_batch_id, model, request_count) "
                       "VALUES ('ended', 'msgbatch_prune', 'm', 2)")
    await conn.execute("INSERT INTO message_batch_items (batch_id, custom_id, job_id, attempt, result, read_at) "
                       "VALUES (1, 'job-1', 1, 1, NULL, NULL), (1, 'job-2', 2, 1, 'succeeded', now())")
    pruned = await PgSweeperStore(conn).prune_finished(retention_s=30 * 86400, batch_size=10)
    assert [job.id for job in pruned] == [2]
    assert [r.id for r in await job_rows(conn)] == [1]


async def test_a_retention_of_ten_years_keeps_a_job_of_nine_and_prunes_one_of_eleven(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool
) -> None:
    """JOB_RETENTION_S of ten years reaches the prune statement whole: a job finished nine years ago stays, one
    finished eleven years ago goes."""
    client = await client_id_of(conn)
    for n in range(2):
        await enqueue(conn, client, f"story {n}")
    await conn.execute("UPDATE story_jobs SET status = 'failed', error_code = 'cancelled', "
                       "completed_at = now() - make_interval(years => CASE id WHEN 1 THEN 11 ELSE 9 END), "
                       "created_at = now() - make_interval(years => CASE id WHEN 1 THEN 11 ELSE 9 END)")
    settings = load(SweeperSettings, {"JOB_RETENTION_S": str(10 * 365 * 86400), "DATABASE_URL": "postgresql://x"})
    sweeper = Sweeper(sweeper_settings(job_retention_s=settings.job_retention_s), PgSweeperStore(pool),
                      clock=FakeClock())
    assert (await sweeper.sweep_once()).pruned == 1
    assert [r.id for r in await job_rows(conn)] == [2]


async def test_the_database_clock_can_be_overridden(conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool) -> None:
    """sweep_once(now=...) judges ages against the given time instead of the database's."""
    client = await client_id_of(conn)
    await enqueue(conn, client, "a fox")
    sweeper = Sweeper(sweeper_settings(pending_timeout_s=1800), PgSweeperStore(pool), clock=FakeClock())
    assert (await sweeper.sweep_once()).reclaimed == 0
    later = await _db_now(conn) + timedelta(seconds=1801)
    assert (await sweeper.sweep_once(now=later)).queue_timeout == 1
    assert later.tzinfo is not None and later > datetime.now(UTC)


async def test_a_long_lock_on_story_jobs_does_not_make_live_jobs_look_dead(
    database_url: str, conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool
) -> None:
    """A lock that blocks heartbeats (a careless migration) makes the sweeper's probe and pass fail
    after a heartbeat interval; afterwards it judges no running job until the database has been
    writable for a whole heartbeat timeout, however stale the heartbeats then look."""
    client = await client_id_of(conn)
    await enqueue(conn, client, "a fox")
    await _claim(conn)
    clock = FakeClock()
    sweeper = Sweeper(sweeper_settings(heartbeat_interval_s=0.2, heartbeat_timeout_s=60, job_timeout_s=480),
                      PgSweeperStore(pool), clock=clock)
    await sweeper.probe()
    clock.now += 61
    migration = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    async with migration, migration.transaction():
        await migration.execute("LOCK TABLE story_jobs IN SHARE MODE")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            await sweeper.probe()
        sweeper.connection_lost()
        with pytest.raises(psycopg.errors.LockNotAvailable):
            await sweeper.sweep_once()
        sweeper.connection_lost()
    # the lock is gone; the job's heartbeat looks five minutes old, but workers could not write
    stale = await _db_now(conn) + timedelta(minutes=5)
    result = await sweeper.sweep_once(now=stale)
    assert not result.judged_running and result.reclaimed == 0
    clock.now += 61
    assert (await sweeper.sweep_once(now=stale)).interrupted == 1


async def test_a_read_only_database_pauses_the_judging_of_running_jobs(
    database_url: str, database_name: str, server_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """While the database is read-only (a failover, an operator's switch) the probe fails as a heartbeat
    would; once writable again, running jobs wait a heartbeat timeout before they are judged, for the
    job timeout as for heartbeats."""
    from psycopg import sql

    from shared import db

    client = await client_id_of(conn)
    await enqueue(conn, client, "a fox")
    await _claim(conn)
    await conn.execute("UPDATE story_jobs SET started_at = now() - interval '1 hour'")
    clock = FakeClock()
    sweeper_pool = db.make_pool(database_url, application_name="storyjobs-sweeper", connect_timeout_s=5,
                                statement_timeout_s=10, min_size=1, max_size=1, wait_timeout_s=5)
    name = sql.Identifier(database_name)
    async with sweeper_pool, await psycopg.AsyncConnection.connect(server_url, autocommit=True) as admin:

        async def reconnect_sweeper() -> None:
            # a database setting reaches new sessions only
            await admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE application_name = 'storyjobs-sweeper' AND datname = %s", (database_name,))
            await sweeper_pool.check()

        sweeper = Sweeper(sweeper_settings(heartbeat_timeout_s=60, job_timeout_s=480), PgSweeperStore(sweeper_pool), clock=clock)
        await sweeper.probe()
        clock.now += 61
        await admin.execute(sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(name))
        try:
            await reconnect_sweeper()
            with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                await sweeper.probe()
            sweeper.connection_lost()
        finally:
            await admin.execute(sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(name))
        await reconnect_sweeper()
        result = await sweeper.sweep_once()
        assert not result.judged_running and result.timed_out == 0
        clock.now += 61
        assert (await sweeper.sweep_once()).timed_out == 1


async def test_a_pass_records_the_current_minute_for_the_consoles_history(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool
) -> None:
    """Each pass writes the current minute's row of minute_rollup with the queue depth it saw and the jobs claimed
    in it, and a later pass that sees a deeper queue in the same minute keeps the deeper one."""
    client = await client_id_of(conn)
    for n in range(3):
        await enqueue(conn, client, f"story {n}")
    await _claim(conn, 1)
    sweeper = Sweeper(sweeper_settings(), PgSweeperStore(pool))
    await sweeper.sweep_once()
    for n in range(3, 6):
        await enqueue(conn, client, f"story {n}")
    await sweeper.sweep_once()
    await _claim(conn, 5)
    await sweeper.sweep_once()
    (deepest, busiest), = await (await conn.execute(
        "SELECT max(pending_max), max(running_max) FROM minute_rollup")).fetchall()
    claimed = await (await conn.execute("SELECT count(*) FROM story_jobs WHERE started_at IS NOT NULL")).fetchone()
    # the passes may straddle a minute's end: each depth is kept in the minute it was seen
    assert (deepest, busiest) == (5, 6)
    total = await (await conn.execute("SELECT sum(n) FROM minute_rollup, unnest(wait_counts) n")).fetchone()
    assert claimed is not None and total is not None and total[0] == claimed[0] == 6


async def test_a_batch_job_that_waited_past_its_day_fails_and_leaves_the_batch_line(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    """A batch job no batch took within BATCH_COLLECT_S and a day fails as queue_timeout, and no longer waits
    for a batch: the lane's next intent does not take it."""
    client = await client_id_of(conn)
    await enqueue_batch(conn, client, "a story no batch took", waited_s=2 * 86_400)
    clock = FakeClock()
    sweeper = Sweeper(sweeper_settings(), PgSweeperStore(pool), clock=clock)
    await sweeper.probe()
    clock.now += 61
    assert (await sweeper.sweep_once()).queue_timeout == 1
    assert [(r.status, r.error_code) for r in await job_rows(conn)] == [("failed", "queue_timeout")]
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE batch_ready_at IS NOT NULL") == 0


async def test_one_prune_statement_deletes_at_most_its_batch(conn: psycopg.AsyncConnection[Any]) -> None:
    """Each prune statement deletes at most SWEEPER_BATCH_SIZE jobs (what bounds its locks and its time): five
    jobs past retention go two, two and one."""
    client = await client_id_of(conn)
    jobs = [await enqueue(conn, client, f"story {n}") for n in range(5)]
    await conn.execute("UPDATE story_jobs SET status = 'failed', error_code = 'cancelled', "
                       "created_at = now() - interval '40 days', completed_at = now() - interval '40 days'")
    store = PgSweeperStore(conn)
    batches = [len(await store.prune_finished(retention_s=30 * 86400, batch_size=2)) for _ in range(4)]
    assert batches == [2, 2, 1, 0]
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE public_id = ANY(%s)", jobs) == 0


async def test_a_job_changed_while_the_prune_waits_for_it_stays_with_its_key(
    conn: psycopg.AsyncConnection[Any], database_url: str,
) -> None:
    """The prune deletes the rows its walk found, where it found them. A job whose row another transaction
    changes (a late ledger change moving a finished job's charge) while the prune waits for it has moved: that
    batch keeps the job and its idempotency key and deletes the other two with theirs; the next batch deletes
    the changed job and its key."""
    client = await client_id_of(conn)
    jobs = [await enqueue(conn, client, f"story {n}") for n in range(3)]
    await conn.execute("UPDATE story_jobs SET status = 'failed', error_code = 'cancelled', "
                       "created_at = now() - interval '40 days', completed_at = now() - interval '40 days'")
    month = 30 * 86400.0
    async with (await psycopg.AsyncConnection.connect(database_url) as changing,
                await psycopg.AsyncConnection.connect(database_url, autocommit=True) as pruning_conn):
        await changing.execute("UPDATE story_jobs SET charged_usd = 0.25 WHERE public_id = %s", (jobs[0],))
        pruning = asyncio.create_task(PgSweeperStore(pruning_conn).prune_finished(retention_s=month,
                                                                                  batch_size=10))
        await wait_until(lambda: waiting_on_a_lock(conn), what="the prune to wait for the changed job's row")
        await changing.commit()
        first = await pruning
    store = PgSweeperStore(conn)
    kept = await (await conn.execute(
        "SELECT j.public_id, j.charged_usd, k.idempotency_key IS NOT NULL FROM story_jobs j "
        "LEFT JOIN job_idempotency_keys k ON k.job_id = j.id")).fetchall()
    assert len(first) == 2
    assert kept == [(jobs[0], Decimal("0.25"), True)]
    assert await count(conn, "SELECT count(*) FROM job_idempotency_keys") == 1
    second = await store.prune_finished(retention_s=month, batch_size=10)
    assert len(second) == 1
    assert await count(conn, "SELECT count(*) FROM story_jobs") == 0
    assert await count(conn, "SELECT count(*) FROM job_idempotency_keys") == 0


async def test_a_batch_walks_on_from_the_last_job_the_batch_before_deleted(
    conn: psycopg.AsyncConnection[Any], database_url: str,
) -> None:
    """A deleted job's entry stays in the key's index until a VACUUM and, while a snapshot older than the delete
    is open, the walk reads its row to learn so. Walking on from the last job deleted, the batch after 5,000
    reads the pages of its own five jobs; from the start, it reads theirs too."""
    client = await client_id_of(conn)
    await conn.execute(
        "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, status, error_code, "
        "                        created_at, completed_at) "
        "SELECT %(client)s, 'walked-' || n, 'f', '{}'::jsonb, 'failed', 'cancelled', "
        "       now() - interval '40 days', now() - interval '40 days' FROM generate_series(1, 5005) n",
        {"client": client})
    store = PgSweeperStore(conn)
    month = 30 * 86400.0
    below_id = await store.prune_below_id(retention_s=month)
    async with await psycopg.AsyncConnection.connect(database_url) as reading:
        # a transaction whose snapshot predates the deletes: their rows stay visible to it
        await reading.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await reading.execute("SELECT count(*) FROM story_jobs")
        deleted = await store.prune_finished(retention_s=month, batch_size=5000, below_id=below_id)
        last = max(job.id for job in deleted)
        params = {"retention_s": month, "batch_size": 5, "now": None, "below_id": below_id}
        walked_on = await pages_read(conn, "job_prune_finished", {**params, "after_id": last})
        from_the_start = await pages_read(conn, "job_prune_finished", {**params, "after_id": 0})
        await reading.rollback()
    assert len(deleted) == 5000
    assert walked_on <= 40 < 3 * walked_on < from_the_start
    assert len(await store.prune_finished(retention_s=month, batch_size=10, below_id=below_id,
                                          after_id=last)) == 5


async def test_a_ledger_batch_walks_on_from_the_latest_start_the_batch_before_deleted(
    conn: psycopg.AsyncConnection[Any], database_url: str,
) -> None:
    """A deleted call's entry stays in the index until a VACUUM and, while a snapshot older than the delete is
    open, the walk reads its row to learn so. Walking on from the latest start deleted, the batch after 5,000
    reads the pages of its own five calls; from the oldest, it reads theirs too."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    await conn.execute(
        "INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model, started_at) "
        "SELECT n, 1, 'w', 'anthropic', 'm', %(start)s + n * interval '1 second' FROM generate_series(1, 5005) n",
        {"start": start})
    store = PgSweeperStore(conn)
    month, now = 30 * 86400.0, start + timedelta(days=40)
    async with await psycopg.AsyncConnection.connect(database_url) as reading:
        # a transaction whose snapshot predates the deletes: their rows stay visible to it
        await reading.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await reading.execute("SELECT count(*) FROM llm_calls")
        deleted = await store.prune_ledger(retention_s=month, batch_size=5000, now=now)
        params = {"retention_s": month, "batch_size": 5, "now": now}
        walked_on = await pages_read(conn, "ledger_prune", {**params, "after": deleted.last_started_at})
        from_the_oldest = await pages_read(conn, "ledger_prune", {**params, "after": None})
        await reading.rollback()
    assert deleted == LedgerPruned(5000, start + timedelta(seconds=5000))
    assert walked_on <= 40 < 3 * walked_on < from_the_oldest
    assert await store.prune_ledger(retention_s=month, batch_size=10, now=now,
                                    after=deleted.last_started_at) == LedgerPruned(5, start + timedelta(seconds=5005))


async def test_a_ledger_batch_walks_on_from_the_very_instant_the_batch_before_ended_at(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """Two calls can start at one instant: the batch that deleted one of them ended there, and the next batch
    walks from that instant, not past it, so the other goes before the call a second later."""
    instant = datetime(2026, 1, 1, tzinfo=UTC)
    await conn.execute(
        "INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model, started_at) VALUES "
        "(1, 1, 'w', 'anthropic', 'm', %(instant)s), (2, 1, 'w', 'anthropic', 'm', %(instant)s), "
        "(3, 1, 'w', 'anthropic', 'm', %(instant)s + interval '1 second')", {"instant": instant})
    store = PgSweeperStore(conn)
    month, now = 30 * 86400.0, instant + timedelta(days=40)
    first = await store.prune_ledger(retention_s=month, batch_size=1, now=now)
    assert first == LedgerPruned(1, instant)
    assert await store.prune_ledger(retention_s=month, batch_size=1, now=now, after=instant) == first
    assert await _ledger_jobs(conn) == [3]
