"""A 410 Gone (webhook_delivery_finish, outcome gone) disables the endpoint
that answered it and drops that endpoint's other undelivered deliveries, and
no other endpoint's: the client's other receiver, and every other client's,
still get theirs."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from tests.support.database import client_id_of
from tests.support.deliveries import ended_job, new_endpoint
from worker.delivery.store import PgDeliveryStore


async def test_a_410_drops_only_the_deliveries_of_the_endpoint_that_answered_it(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    client = await client_id_of(conn)
    gone = await new_endpoint(conn, client, "https://gone.example.com/in")
    kept = await new_endpoint(conn, client, "https://kept.example.com/in")
    for _ in range(2):
        await ended_job(conn, client)
    store = PgDeliveryStore(pool)
    (claimed,) = [c for c in await store.claim(limit=10, lease_s=60) if c.endpoint_id == gone][:1]
    assert await store.finish(claimed.id, claimed.lease, "gone", status_code=410) is not None
    cur = await conn.execute("SELECT endpoint_id, state, count(*) FROM webhook_deliveries GROUP BY 1, 2 ORDER BY 1, 2")
    rows = {(endpoint, state): n for endpoint, state, n in await cur.fetchall()}
    assert rows == {(gone, "dead"): 2, (kept, "pending"): 2}
    assert await (await conn.execute("SELECT id FROM webhook_endpoints WHERE disabled_at IS NOT NULL")).fetchall() \
        == [(gone,)]
