"""The sweeper fails the running jobs of a batch that expired without their
results (job_fail_stale's stale_batched), however many of the batch's jobs
had already finished: the finished ones are not what a statement's batch
of SWEEPER_BATCH_SIZE is spent on, so none of the running ones is left
behind them, pass after pass."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from sweeper.store import PgSweeperStore
from tests.support import ops_seed as seed


async def test_an_expired_batchs_running_job_is_failed_behind_a_batch_size_of_finished_ones(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    """A batch sent two days ago and expired a day ago holds three completed jobs and, after them, one still
    running: with a batch size of three, the pass fails the running one as timed out."""
    acme, _ = await seed.client(conn, "acme")
    jobs = await seed.insert_jobs(conn, [seed.completed(acme, 100_000) for _ in range(3)]
                                  + [seed.running(acme, 100_000)])
    await seed.batch(conn, "sent", jobs, created_ago_s=2 * 86400, provider_batch_id="msgbatch_expired",
                     expires_in_s=-86400)
    failed = await PgSweeperStore(pool).fail_stale(
        heartbeat_timeout_s=60, job_timeout_s=10 * 86400, pending_timeout_s=10 * 86400, judge_running=True,
        batch_size=3, lock_timeout_s=5.0)
    assert [(job.id, job.reason) for job in failed] == [(jobs[-1].id, "timed_out")]
