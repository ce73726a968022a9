"""Every request waiting on the admission writer (api.admission
AdmissionBatcher) hears how its batch ended: admitted, or the database's
error (a 503 at the route), each batch on its own, so that no POST is left
waiting and one failed batch does not keep the next from being tried."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, PoolClosed

from api.admission import MAX_BATCH, AdmissionBatcher, admission
from shared.config import ApiSettings
from shared.story_request import StoryRequest
from tests.support.database import client_id_of


def _admissions(client: int, n: int) -> list[Any]:
    return [admission(client, uuid.uuid4().hex, StoryRequest(prompt=f"story {i}"), ApiSettings()) for i in range(n)]


async def test_one_admission_is_answered(pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]) -> None:
    """One request alone is written and answered as inserted, within seconds."""
    batcher = AdmissionBatcher(pool, queue_max=100, client_queue_max=100,
                               batch_queue_max=100, client_batch_queue_max=100, connection_wait_s=5.0)
    (one,) = _admissions(await client_id_of(conn), 1)
    result = await asyncio.wait_for(batcher.admit(one), timeout=10)
    assert result.outcome == "inserted"


async def test_each_waiting_request_hears_its_batchs_database_error_and_the_next_batch_is_tried(
    database_url: str, conn: psycopg.AsyncConnection[Any],
) -> None:
    """More requests than one batch holds, on a pool that cannot give a connection: every request of both
    batches is answered with the pool's own error, within seconds, the second batch tried after the first
    failed."""
    unopened = AsyncConnectionPool(database_url, open=False)
    batcher = AdmissionBatcher(unopened, queue_max=100, client_queue_max=100,
                               batch_queue_max=100, client_batch_queue_max=100, connection_wait_s=1.0)
    requests = _admissions(await client_id_of(conn), MAX_BATCH + 1)
    answers = await asyncio.wait_for(asyncio.gather(*(batcher.admit(a) for a in requests),
                                                    return_exceptions=True), timeout=10)
    assert all(isinstance(answer, PoolClosed) for answer in answers), {type(a).__name__ for a in answers}
    assert batcher.batches_written == 0
    with pytest.raises(PoolClosed):
        await asyncio.wait_for(batcher.admit(_admissions(await client_id_of(conn), 1)[0]), timeout=10)
