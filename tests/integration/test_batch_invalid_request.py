"""A batch job whose stored request no longer validates (worker.batch.submitter,
batch_items_drop): dropped from its intent before the create call, its
ledger row closed as not sent, the job failed as invalid_request and charged
nothing; the intent's other requests are sent as one batch of their number."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from tests.support.database import client_id_of, enqueue_batch
from tests.support.money import money_problems
from tests.support.settings import worker_settings
from worker.batch.lane import BatchLane
from worker.batch.offline_batches import OfflineBatches
from worker.batch.store import BatchStore


async def test_a_stored_request_that_no_longer_validates_fails_its_job_unbilled_and_the_rest_are_sent(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    client = await client_id_of(conn)
    broken = await enqueue_batch(conn, client, "a broken request")
    await enqueue_batch(conn, client, "a sound request")
    await conn.execute("UPDATE story_jobs SET request = '{\"no such field\": 1}'::jsonb WHERE public_id = %s",
                       (broken,))
    provider = OfflineBatches(delay_s=3600)
    settings = worker_settings(batch_collect_s=1.0, batch_poll_interval_s=1.0, batch_max_attempts=3)
    await BatchLane(settings, BatchStore(pool), provider, holder="w-1").tick_once()
    cur = await conn.execute("SELECT j.public_id = %s, j.status::text, j.error_code, j.charged_usd, c.outcome::text, "
                             "c.billed FROM story_jobs j JOIN llm_calls c ON c.job_id = j.id ORDER BY j.id",
                             (broken,))
    assert await cur.fetchall() == [(True, "failed", "invalid_request", Decimal(0), "not_sent", False),
                                    (False, "running", None, None, "started", True)]
    cur = await conn.execute("SELECT state, request_count FROM message_batches")
    assert await cur.fetchall() == [("sent", 1)]
    assert [batch.counts.total for batch in (await provider.list_page()).batches] == [1]
    assert await money_problems(conn) == []
