"""The sweeper fails the running jobs of a batch that expired without their
results, or of an intent never answered (job_fail_stale's stale_batched), however many of the batch's jobs
had already finished: the finished ones are not what a statement's batch
of SWEEPER_BATCH_SIZE is spent on, so none of the running ones is left
behind them, pass after pass."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from sweeper.store import PgSweeperStore
from tests.support import ops_seed as seed


# a batch sent that expired a day ago, and an intent whose create was never
# answered, fenced two days ago (its day and an hour are past)
@pytest.mark.parametrize(("state", "provider_batch_id", "expires_in_s"),
                         [("sent", "msgbatch_expired", -86400), ("intent", None, None)], ids=["sent", "intent"])
async def test_an_expired_batchs_running_job_is_failed_behind_a_batch_size_of_finished_ones(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, state: str, provider_batch_id: str | None,
    expires_in_s: float | None,
) -> None:
    """A batch made two days ago, expired (or, an intent never answered, past its fence's day), holds three
    completed jobs and, after them, one still running: with a batch size of three, the pass fails the running
    one as timed out."""
    acme, _ = await seed.client(conn, "acme")
    jobs = await seed.insert_jobs(conn, [seed.completed(acme, 100_000) for _ in range(3)]
                                  + [seed.running(acme, 100_000)])
    await seed.batch(conn, state, jobs, created_ago_s=2 * 86400, provider_batch_id=provider_batch_id,
                     expires_in_s=expires_in_s)
    failed = await PgSweeperStore(pool).fail_stale(
        heartbeat_timeout_s=60, job_timeout_s=10 * 86400, pending_timeout_s=10 * 86400, judge_running=True,
        batch_size=3, lock_timeout_s=5.0)
    assert [(job.id, job.reason) for job in failed] == [(jobs[-1].id, "timed_out")]
