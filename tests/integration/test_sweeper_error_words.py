"""What the sweeper tells a client whose job it failed (job_fail_stale): the
poll's error_text names the rule that failed it, in words, beside the
error_code a program reads."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from sweeper.store import PgSweeperStore
from tests.support import worker_statements
from tests.support.database import client_id_of, enqueue


async def test_each_rule_says_in_words_why_it_failed_the_job(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    """A job that ran past the job timeout, one whose worker stopped sending heartbeats, and one no worker
    took in time: each fails with its own code and its own words."""
    client = await client_id_of(conn)
    for prompt in ("too long", "worker gone"):
        await enqueue(conn, client, prompt)
    claimed = await worker_statements.job_claim(conn, worker_id="w1", claim_limit=2, provider="offline",
                                                model="offline-writer")
    too_long, worker_gone = sorted(job.id for job in claimed.claimed)
    await enqueue(conn, client, "never taken")
    await conn.execute("UPDATE story_jobs SET started_at = now() - interval '2 hours' WHERE id = %s", (too_long,))
    await conn.execute("UPDATE story_jobs SET heartbeat_at = now() - interval '5 minutes' WHERE id = %s",
                       (worker_gone,))
    await conn.execute("UPDATE story_jobs SET created_at = now() - interval '2 hours' WHERE status = 'pending'")
    await PgSweeperStore(pool).fail_stale(heartbeat_timeout_s=60, job_timeout_s=3600, pending_timeout_s=3600,
                                          judge_running=True, batch_size=10, lock_timeout_s=5.0)
    cur = await conn.execute("SELECT request->>'prompt', status::text, error_code, error_text FROM story_jobs "
                             "ORDER BY id")
    assert await cur.fetchall() == [
        ("too long", "failed", "timed_out", "the story took longer than the job timeout"),
        ("worker gone", "failed", "interrupted", "the worker stopped sending heartbeats"),
        ("never taken", "failed", "queue_timeout", "no worker picked the job up in time"),
    ]
