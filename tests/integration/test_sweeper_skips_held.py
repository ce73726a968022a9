"""The sweeper's stale-job statement (job_fail_stale) skips a job whose row
another session holds (a worker writing its end, a cancel, the batch lane
taking it into a batch) instead of waiting for it, by each of its rules:
the other stale jobs are failed at once, and the held one is judged again
at the next pass, as it then is."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from sweeper.store import PgSweeperStore
from tests.support import ops_seed as seed
from tests.support import worker_statements
from tests.support.database import client_id_of, enqueue, enqueue_batch

Conn = psycopg.AsyncConnection[Any]


async def _stale_running(conn: Conn, client: int) -> tuple[list[int], str]:
    """Two running jobs whose heartbeats are five minutes old."""
    for n in range(2):
        await enqueue(conn, client, f"story {n}")
    claimed = await worker_statements.job_claim(conn, worker_id="w1", claim_limit=2, provider="offline",
                                                model="offline-writer")
    await conn.execute("UPDATE story_jobs SET heartbeat_at = now() - interval '5 minutes'")
    return sorted(job.id for job in claimed.claimed), "running"


async def _stale_pending(conn: Conn, client: int) -> tuple[list[int], str]:
    """Two interactive jobs that have waited two hours, past the pending timeout of one."""
    for n in range(2):
        await enqueue(conn, client, f"story {n}")
    cur = await conn.execute("UPDATE story_jobs SET created_at = created_at - interval '2 hours' RETURNING id")
    return sorted(row[0] for row in await cur.fetchall()), "pending"


async def _stale_batched(conn: Conn, client: int) -> tuple[list[int], str]:
    """Two jobs running in a batch sent two days ago that expired a day ago, without their results."""
    jobs = await seed.insert_jobs(conn, [seed.running(client, 2 * 86400) for _ in range(2)])
    await seed.batch(conn, "sent", jobs, created_ago_s=2 * 86400, provider_batch_id="msgbatch_expired",
                     expires_in_s=-86400)
    return sorted(job.id for job in jobs), "running"


async def _stale_batch_waiting(conn: Conn, client: int) -> tuple[list[int], str]:
    """Two batch jobs that have waited two days for a batch, past their day and its collection."""
    for n in range(2):
        await enqueue_batch(conn, client, f"story {n}", waited_s=2 * 86400.0)
    cur = await conn.execute("SELECT id FROM story_jobs ORDER BY id")
    return [row[0] for row in await cur.fetchall()], "pending"


@pytest.mark.parametrize("stale", [_stale_pending, _stale_running, _stale_batch_waiting, _stale_batched],
                         ids=["pending", "running", "batch-waiting", "batched"])
async def test_a_held_stale_job_is_skipped_and_the_others_are_failed_without_waiting(
    conn: Conn, pool: AsyncConnectionPool, database_url: str, stale: Any,
) -> None:
    """Two stale jobs, the first held by another session: the statement answers at once (with a lock
    timeout of 5 s it would otherwise wait and fail) with the second failed, and the first as it was."""
    (held, free), status = await stale(conn, await client_id_of(conn))
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as holder, \
            holder.transaction():
        await holder.execute("SELECT id FROM story_jobs WHERE id = %s FOR UPDATE", (held,))
        failed = await asyncio.wait_for(PgSweeperStore(pool).fail_stale(
            heartbeat_timeout_s=60, job_timeout_s=3600, pending_timeout_s=3600, judge_running=True,
            batch_size=10, lock_timeout_s=5.0, batch_collect_s=60.0), timeout=2.0)
    assert [job.id for job in failed] == [free]
    cur = await conn.execute("SELECT id, status::text FROM story_jobs ORDER BY id")
    assert await cur.fetchall() == [(held, status), (free, "failed")]
