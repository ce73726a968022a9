"""Behind a real PgBouncer in transaction pooling, with the pools the processes
build for DATABASE_POOLER=transaction: nothing relies on session state, the
statement timeout is kept by the client, and every guarantee holds as it
does on direct connections (strict admission, idempotency, guarded
transitions, one ledger row per request)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from shared import db
from shared.queries import QUERIES
from shared.ratelimit import NO_LIMITS, RateLimits, claim_params
from shared.status import ErrorCode, LlmOutcome
from sweeper.store import PgSweeperStore
from tests.support import worker_statements
from tests.support.api_client import api_client, new_key
from tests.support.database import client_id_of, count, create_key, enqueue, job_rows, story_written
from tests.support.pgbouncer import PgBouncer
from tests.support.settings import LATER, SWEEP, worker_settings
from tests.support.waiting import wait_until
from tests.support.workers import running_worker
from worker.offline import OfflineWriter
from worker.pg_store import settle_params
from worker.rows import Failure
from worker.store import ClaimAsk


@contextlib.asynccontextmanager
async def pooled(bouncer: PgBouncer, database_name: str, *, max_size: int = 10,
                 statement_timeout_s: float = 30.0) -> AsyncIterator[AsyncConnectionPool]:
    """A pool through ``bouncer`` as a process builds it with DATABASE_POOLER=transaction."""
    pool = db.make_pool(bouncer.url(database_name), application_name="storyjobs-test", connect_timeout_s=5,
                        statement_timeout_s=statement_timeout_s, min_size=1, max_size=max_size,
                        wait_timeout_s=10, generic_plans=True, pooler="transaction")
    await pool.open(wait=True)
    try:
        yield pool
    finally:
        await pool.close()


async def _advisory_locks(conn: psycopg.AsyncConnection[Any]) -> int:
    # this database's only: other databases on the server are other tests'
    return await count(conn, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = "
                             "(SELECT oid FROM pg_database WHERE datname = current_database())")


async def test_a_connection_with_session_options_is_refused_by_the_pooler_and_a_pooled_one_is_not(
    pgbouncer: PgBouncer, database_name: str
) -> None:
    """A connection made as for DATABASE_POOLER=none sends startup options, which PgBouncer refuses; the pool
    made for DATABASE_POOLER=transaction connects and answers."""
    with pytest.raises(psycopg.OperationalError, match="unsupported startup parameter: options"):
        await db.connect(pgbouncer.url(database_name), application_name="storyjobs-test", connect_timeout_s=5,
                         statement_timeout_s=30, generic_plans=True)
    async with pooled(pgbouncer, database_name) as pool, pool.connection() as conn:
        assert await count(conn, "SELECT 1") == 1


async def test_every_statement_runs_many_times_on_shared_server_connections(
    pgbouncer_factory: Callable[..., PgBouncer], database_name: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Claims, heartbeats, completions (with a claim, in one pipelined transaction) and failures, each run far past
    psycopg's prepare threshold by 8 tasks sharing 2 server connections, never meet a missing or duplicate prepared
    statement."""
    bouncer = pgbouncer_factory(default_pool_size=2)
    client = await client_id_of(conn)
    for n in range(80):
        await enqueue(conn, client, f"story {n}")

    async def worker(pool: AsyncConnectionPool, number: int) -> int:
        done = 0
        worker_id = f"w{number}"
        while True:
            async with pool.connection() as c:
                settled = await worker_statements.job_claim(c, worker_id=worker_id, claim_limit=1,
                                                           provider="offline", model="offline-writer")
            if not settled.claimed:
                return done
            (job,) = settled.claimed
            async with pool.connection() as c:
                beats = await worker_statements.job_heartbeat(c, worker_id=worker_id, progress={job.id: 1})
                assert [b.alive for b in beats] == [True]
                if job.id % 2:
                    await worker_statements.job_fail_running(c, worker_id=worker_id, failures=[Failure(
                        job_id=job.id, attempt=1, error_code=ErrorCode.LLM_ERROR, error_text="x",
                        call_outcome=LlmOutcome.FAILED, billed=True)])
                else:
                    # the round's one transaction: the story settled and a claim, one pipeline
                    store = worker_statements.store_on(c, worker_id=worker_id, provider="offline",
                                                       model="offline-writer")
                    written = await store.settle_and_claim([story_written(job.id)], ClaimAsk(0), NO_LIMITS)
                    assert written.settled is not None and written.settled.completed_ids == [job.id]
            done += 1

    async with pooled(bouncer, database_name, max_size=8) as pool:
        assert sum(await asyncio.gather(*(worker(pool, n) for n in range(8)))) == 80
    assert {row.status for row in await job_rows(conn)} == {"completed", "failed"}
    assert await count(conn, "SELECT count(*) FROM llm_calls WHERE outcome IN ('succeeded', 'failed')") == 80


async def test_the_statement_timeout_is_kept_by_the_client_and_cancels_the_statement_on_the_server(
    pgbouncer: PgBouncer, database_name: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A pooled statement blocked by a lock fails with QueryCanceled after the statement timeout, the server
    stops running it at once, and the pooled connection serves the next statement."""
    async with pooled(pgbouncer, database_name, statement_timeout_s=0.5) as pool:
        async with conn.transaction():
            await conn.execute("LOCK TABLE story_jobs IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            with pytest.raises(psycopg.errors.QueryCanceled, match="statement timeout"):
                async with pool.connection() as pooled_conn:
                    await PgSweeperStore(pooled_conn).queue_gauges()
            waited = time.monotonic() - started
            # cancelled on the server too: nothing is left waiting for the lock we still hold
            assert await count(conn, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                     "AND wait_event_type = 'Lock'") == 0
        assert 0.5 <= waited < 3
        async with pool.connection() as pooled_conn:
            assert (await PgSweeperStore(pooled_conn).queue_gauges()).pending == 0


async def test_admissions_from_three_replicas_through_the_pooler_stay_idempotent_and_strict(
    pgbouncer_factory: Callable[..., PgBouncer], database_name: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Three api replicas sharing two server connections: 30 concurrent POSTs with one key make one job, then
    90 with distinct keys against QUEUE_MAX=10 store exactly 9 more; no advisory lock outlives its transaction."""
    bouncer = pgbouncer_factory(default_pool_size=2)
    headers = {"Authorization": f"Bearer {await create_key(conn, 'tester')}"}
    async with contextlib.AsyncExitStack() as stack:
        replicas: list[httpx.AsyncClient] = []
        for _ in range(3):
            pool = await stack.enter_async_context(pooled(bouncer, database_name, max_size=4))
            # deadlines far above what two server connections need: under a loaded machine a
            # 503 here would be a slow answer, not a wrong one
            replicas.append(await stack.enter_async_context(
                api_client(pool, queue_max=10, api_db_wait_s=20, api_request_timeout_s=30)))
        replays = await asyncio.gather(*(
            replicas[n % 3].post("/stories/generate", json={"prompt": "one"},
                                 headers={**headers, "Idempotency-Key": "same"}) for n in range(30)))
        answers = await asyncio.gather(*(
            replicas[n % 3].post("/stories/generate", json={"prompt": f"story {n}"}, headers={**headers, **new_key()})
            for n in range(90)))
    assert {answer.status_code for answer in replays} == {202}
    assert len({answer.json()["job_id"] for answer in replays}) == 1
    statuses = [answer.status_code for answer in answers]
    assert statuses.count(202) == 9 and statuses.count(429) == 81, statuses
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE status = 'pending'") == 10
    assert await _advisory_locks(conn) == 0


async def test_sixteen_claimers_through_the_pooler_claim_every_job_once(
    pgbouncer_factory: Callable[..., PgBouncer], database_name: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """16 claimers sharing 3 server connections claim each of 200 jobs exactly once, with one ledger row each."""
    bouncer = pgbouncer_factory(default_pool_size=3)
    client = await client_id_of(conn)
    for n in range(200):
        await enqueue(conn, client, f"story {n}")

    async def claimer(pool: AsyncConnectionPool, number: int) -> list[int]:
        mine: list[int] = []
        while True:
            async with pool.connection() as c:
                result = await worker_statements.job_claim(
                    c, worker_id=f"claimer-{number}", claim_limit=1 + number % 3,
                    provider="offline", model="offline-writer")
            if not result.claimed:
                return mine
            mine.extend(job.id for job in result.claimed)

    async with pooled(bouncer, database_name, max_size=16) as pool:
        claims = await asyncio.gather(*(claimer(pool, n) for n in range(16)))
    every = [job_id for mine in claims for job_id in mine]
    assert len(every) == 200 and len(set(every)) == 200
    assert sum(1 for mine in claims if mine) > 1
    assert await count(conn, "SELECT count(*) FROM llm_calls WHERE attempt = 1") == 200


async def test_a_job_swept_through_the_pooler_is_a_lost_race_for_its_worker(
    pgbouncer: PgBouncer, database_name: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Through the pooler the sweeper fails a running job, whose heartbeat then finds it gone and whose
    completion is a lost race: the job stays failed, and the paid-for story is kept with its one ledger row."""
    client = await client_id_of(conn)
    await enqueue(conn, client, "a fox")
    async with pooled(pgbouncer, database_name) as pool, pool.connection() as c:
        (job,) = (await worker_statements.job_claim(c, worker_id="w1", claim_limit=1,
                                                   provider="offline", model="offline-writer")).claimed
        swept = await PgSweeperStore(c).fail_stale(now=LATER, **SWEEP)
        assert [s.id for s in swept] == [job.id]
        (beat,) = await worker_statements.job_heartbeat(c, worker_id="w1", progress={job.id: 5})
        assert not beat.alive and beat.error_code == "timed_out"
        settled = await worker_statements.job_settle(c, worker_id="w1", completions=[story_written(job.id)])
        assert settled.completed_ids == [] and settled.already_completed_ids == []
    (row,) = await job_rows(conn)
    assert row.status == "failed" and row.error_code == "timed_out" and row.story_id is None
    assert await count(conn, "SELECT count(*) FROM stories") == 1
    assert await count(conn, "SELECT count(*) FROM llm_calls") == 1
    assert await count(conn, "SELECT count(*) FROM llm_calls WHERE outcome = 'succeeded' AND billed") == 1


async def test_a_worker_on_the_pooler_wakes_at_once_through_its_direct_listen_connection(
    pgbouncer: PgBouncer, database_name: str, database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A worker whose pool goes through the pooler and whose LISTEN goes direct claims a job admitted through
    the pooler within seconds, with its fallback poll a minute away."""
    settings = worker_settings(worker_poll_interval_s=60.0, database_pooler="transaction",
                               database_url=pgbouncer.url(database_name), database_listen_url=database_url)
    client = await client_id_of(conn)
    async with pooled(pgbouncer, database_name) as pool, \
            running_worker(settings, pool, OfflineWriter(0), listen_url=db.session_url(settings)) as worker:
        await wait_until(lambda: _listening(conn), what="the worker to listen")
        # its first claim, at start, found nothing: it now waits to be woken
        await wait_until(lambda: _claimed_once(conn), what="the worker's first claim")
        async with pool.connection() as c:
            await enqueue(c, client, "a fox")
        # well inside the poll's minute, with room for a slow machine
        await wait_until(lambda: _completed(conn), what="the job to complete", timeout=30)
        assert worker.claims == 1
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE started_at - created_at < interval '10 s'") == 1


async def _listening(conn: psycopg.AsyncConnection[Any]) -> bool:
    return await count(conn, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                             "AND application_name = 'storyjobs-worker-listen'") == 1


async def _claimed_once(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether a server connection has run the worker's claim and gone idle
    since: pg_stat_activity keeps the start of the last statement, up to its
    first parameter."""
    start = QUERIES["job_claim"].split("%(")[0]
    return await count(conn, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                             "AND state = 'idle' AND starts_with(query, %s)", start) >= 1


async def _completed(conn: psycopg.AsyncConnection[Any]) -> bool:
    return await count(conn, "SELECT count(*) FROM story_jobs WHERE status = 'completed'") == 1


async def _fill_with_stale_statistics(conn: psycopg.AsyncConnection[Any]) -> list[int]:
    """20,000 finished jobs and 50 running ones, the statistics taken while the table held 10 rows: the
    state in which a plan made early could still be in use. Returns the running jobs' ids."""
    await conn.execute("INSERT INTO api_clients (name) VALUES ('explain')")
    await conn.execute("INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, turn) "
                       "SELECT 1, 'early' || g, '\\x00', '{\"prompt\": \"x\"}', g FROM generate_series(1, 10) g")
    await conn.execute("ANALYZE story_jobs")
    await conn.execute("INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, turn) "
                       "SELECT 1, 'k' || g, '\\x00', '{\"prompt\": \"x\"}', g FROM generate_series(1, 20040) g")
    await conn.execute("UPDATE story_jobs SET status = 'completed', started_at = now(), completed_at = now(), "
                       "story_id = gen_random_uuid(), worker_id = 'old' WHERE id <= 20000")
    await conn.execute("UPDATE story_jobs SET status = 'running', started_at = now(), heartbeat_at = now(), "
                       "worker_id = 'w' WHERE id > 20000")
    await conn.execute("INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model) "
                       "SELECT id, 1, worker_id, 'offline', 'm' FROM story_jobs")
    cur = await conn.execute("SELECT id FROM story_jobs WHERE status = 'running' ORDER BY id LIMIT 5")
    return [row[0] for row in await cur.fetchall()]


def _scans(plan: dict[str, Any]) -> list[str]:
    found = []
    if "Scan" in plan["Node Type"] and plan.get("Relation Name") in ("story_jobs", "llm_calls"):
        found.append(f"{plan['Node Type']} on {plan['Relation Name']}")
    for child in plan.get("Plans", []):
        found.extend(_scans(child))
    return found


async def _scans_when_run(conn: psycopg.AsyncConnection[Any], query: str, params: dict[str, Any]) -> list[str]:
    """The scans of story_jobs and llm_calls in the plans a statement ran with, its own and those of the
    statements inside the functions it calls (auto_explain's nested plans, sent back as notices); run in a
    transaction that is rolled back."""
    plans: list[dict[str, Any]] = []

    def keep_plan(notice: psycopg.errors.Diagnostic) -> None:
        text = notice.message_primary or ""
        if "plan:" in text:
            plans.append(json.loads(text.split("plan:", 1)[1])["Plan"])

    conn.add_notice_handler(keep_plan)
    try:
        async with conn.transaction(force_rollback=True):
            await conn.execute("LOAD 'auto_explain'")
            for setting, value in (("log_min_duration", "0"), ("log_nested_statements", "on"),
                                   ("log_format", "json"), ("log_level", "notice")):
                await conn.execute(f"SET LOCAL auto_explain.{setting} = {value}")
            await conn.execute("SET LOCAL client_min_messages = notice")
            await conn.execute(query, params)
    finally:
        conn.remove_notice_handler(keep_plan)
    return [scan for plan in plans for scan in _scans(plan)]


async def test_without_session_settings_the_worker_statements_still_find_jobs_by_index(
    pgbouncer: PgBouncer, database_name: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """On a pooled connection (no enable_seqscan=off, no forced generic plans: each statement is planned when it
    runs, with its parameters) the worker's statements reach story_jobs and llm_calls through their indexes,
    also with statistics taken when the table held ten rows."""
    running = await _fill_with_stale_statistics(conn)
    beats = json.dumps([{"id": job_id, "progress": 3} for job_id in running])
    failures = json.dumps([{"job_id": job_id, "attempt": 1, "error_code": "llm_error", "error_text": "x",
                            "call_outcome": "failed", "billed": True, "input_tokens": 0, "output_tokens": 0,
                            "cost_usd": 0} for job_id in running])
    claim = {"worker_id": "w", "claim_limit": 5, "provider": "p", "model": "m"}
    limits = RateLimits(requests_rate=1.0, requests_capacity=5.0, input_tokens_rate=1000.0,
                        input_tokens_capacity=5000.0, output_tokens_rate=1000.0, output_tokens_capacity=5000.0)
    stories = [story_written(job_id) for job_id in running]
    limited = claim_params(limits, None, default_max_tokens=1000)
    statements = [
        ("job_heartbeat", {"worker_id": "w", "beats": beats}),
        ("job_settle", settle_params(stories, NO_LIMITS, worker_id="w", model="m")),
        ("job_settle", settle_params(stories, limits, worker_id="w", model="m")),
        ("job_claim", {**claim, **claim_params(NO_LIMITS, None, default_max_tokens=1000)}),
        ("job_claim", {**claim, **limited}),
        ("job_fail_running", {"worker_id": "w", "failures": failures, "model": "m", "limited": True}),
        ("llm_call_start", {**limited, "model": "m", "worker_id": "w", "job_id": running[0], "previous_attempt": 1,
                            "previous_outcome": "rate_limited", "previous_billed": False, "previous_error": "x"}),
    ]
    async with pooled(pgbouncer, database_name) as pool, pool.connection() as pooled_conn:
        for name, params in statements:
            scans = await _scans_when_run(pooled_conn, QUERIES[name], params)
            # index scans, or bitmap heap scans fed by an index: never a walk of the table, also inside the
            # functions a statement calls (jobs_end, migration 019)
            assert scans and not any(s.startswith("Seq Scan") for s in scans), (name, scans)
