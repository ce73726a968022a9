"""Which batch queue a 429 says is full (api.enqueue): the client's own
(CLIENT_BATCH_QUEUE_MAX), so that it knows no other client is what holds
it back, or the service's (BATCH_QUEUE_MAX), shared by all."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from tests.support.api_client import api_client, assert_problem, new_key
from tests.support.database import create_key

BATCH = {"prompt": "a whale", "lane": "batch"}


async def test_a_full_batch_queue_says_whose_it_is(pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]) -> None:
    """With room for two batch jobs in all and one per client: a client's second job is refused as its own
    queue being full; another client's job once the two are taken, as the batch queue being full."""
    parent, teacher, nurse = [await create_key(conn, name) for name in ("parent", "teacher", "nurse")]

    async def post(client: Any, key: str) -> Any:
        return await client.post("/stories/generate", json=BATCH,
                                 headers={"Authorization": f"Bearer {key}", **new_key()})

    async with api_client(pool, batch_queue_max=2, client_batch_queue_max=1) as client:
        first, second = await post(client, parent), await post(client, parent)
        assert (await post(client, teacher)).status_code == 202
        third = await post(client, nurse)
    assert first.status_code == 202
    assert assert_problem(second, 429)["detail"].startswith("your batch queue is full")
    assert assert_problem(third, 429)["detail"].startswith("the batch queue is full")
