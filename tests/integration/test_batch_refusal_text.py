"""What a job refused with its batch says (worker.batch.submitter): the
provider's message, after "the batch was refused: ", kept up to the 500
characters a job's error text holds, as every other error is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from tests.support.database import client_id_of, enqueue_batch
from tests.support.settings import worker_settings
from worker.batch.lane import BatchLane
from worker.batch.offline_batches import OfflineBatches
from worker.batch.provider import BatchNotCreated
from worker.batch.provider_structs import BatchInfo, BatchRequest
from worker.batch.store import BatchStore


class _Refusing(OfflineBatches):
    """Refuses every create as the provider refuses a request it will not take, with a long message."""

    async def create(self, requests: Sequence[BatchRequest]) -> BatchInfo:
        raise BatchNotCreated("x" * 600, retryable=False)


async def test_a_refused_batchs_jobs_keep_its_message_up_to_500_characters(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    """A batch refused with a 600-character message at its job's last attempt fails the job as
    llm_rejected, its error the message's first 477 characters after the 23 of "the batch was refused: "."""
    await enqueue_batch(conn, await client_id_of(conn), "a refused owl")
    settings = worker_settings(batch_collect_s=1.0, batch_poll_interval_s=1.0, batch_max_attempts=1)
    await BatchLane(settings, BatchStore(pool), _Refusing(delay_s=0), holder="w-1").tick_once()
    cur = await conn.execute("SELECT status::text, error_code, error_text FROM story_jobs")
    [(status, code, text)] = await cur.fetchall()
    assert (status, code) == ("failed", "llm_rejected")
    assert text == "the batch was refused: " + "x" * 477
