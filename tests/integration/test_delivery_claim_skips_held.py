"""webhook_delivery_claim (sql/worker.sql) skips a delivery whose row another
session holds (another worker's claim of it, or its attempt being recorded)
instead of waiting for it: workers never wait for each other, and the other
due deliveries go at once."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from tests.support.database import client_id_of
from tests.support.deliveries import ended_job, new_endpoint
from worker.delivery.store import PgDeliveryStore


async def test_a_held_delivery_is_skipped_and_the_others_are_claimed_without_waiting(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
) -> None:
    client = await client_id_of(conn)
    await new_endpoint(conn, client, "https://hooks.example.com/in")
    for _ in range(2):
        await ended_job(conn, client)
    cur = await conn.execute("SELECT id FROM webhook_deliveries ORDER BY id")
    held, free = [row[0] for row in await cur.fetchall()]
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as holder, \
            holder.transaction():
        await holder.execute("SELECT id FROM webhook_deliveries WHERE id = %s FOR UPDATE", (held,))
        claimed = await asyncio.wait_for(PgDeliveryStore(pool).claim(limit=10, lease_s=60), timeout=2.0)
    assert [c.id for c in claimed] == [free]
    cur = await conn.execute("SELECT id, attempts FROM webhook_deliveries ORDER BY id")
    assert await cur.fetchall() == [(held, 0), (free, 1)]
