"""The rules POST /webhook-endpoints enforces, through the api's real app in
the test's event loop on a real Postgres: the URL rule, and the endpoint
limit under concurrent registrations."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from api.store import ApiStore
from api.webhooks import MAX_ENDPOINTS_PER_CLIENT
from shared import db, webhooks
from tests.support import ops_seed as seed
from tests.support.api_client import api_client, assert_problem
from tests.support.database import count
from tests.support.waiting import wait_until


@pytest.mark.parametrize("url", [
    "https://[64:ff9b::a9fe:a9fe]/", "https://[64:ff9b:1::a9fe:a9fe]/", "https://[::ffff:0:a00:1]/",
    "https://[::a00:1]/", "https://[fec0::1]/", "https://2130706433/", "https://0x7f.0.0.1/", "https://127.1/",
    "https://0177.0.0.1/", "https://127.0.0.1./",
])
async def test_a_url_reaching_a_non_public_address_is_refused_naming_why(
        pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], url: str) -> None:
    """NAT64, IPv4-translated or -compatible, site-local, and loopback in the resolver's numeric spellings: a 422 on url."""
    _, key = await seed.client(conn, "acme")
    async with api_client(pool, key) as client:
        body = assert_problem(await client.post("/webhook-endpoints", json={"url": url}), 422)
    assert [e["field"] for e in body["errors"]] == ["url"] and body["errors"][0]["message"]
    assert await count(conn, "SELECT count(*) FROM webhook_endpoints") == 0


async def test_concurrent_registrations_of_one_client_make_exactly_the_limit(
        pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]) -> None:
    """30 registrations at once by one client: exactly MAX_ENDPOINTS_PER_CLIENT are made, the rest are 409s."""
    _, key = await seed.client(conn, "acme")
    async with api_client(pool, key) as client:
        answers = await asyncio.gather(*(
            client.post("/webhook-endpoints", json={"url": f"https://h{n}.example.com/in"}) for n in range(30)))
    statuses = [answer.status_code for answer in answers]
    assert (statuses.count(201), statuses.count(409)) == (MAX_ENDPOINTS_PER_CLIENT, 30 - MAX_ENDPOINTS_PER_CLIENT)
    assert await count(conn, "SELECT count(*) FROM webhook_endpoints") == MAX_ENDPOINTS_PER_CLIENT


async def test_registrations_started_together_on_30_connections_make_exactly_the_limit(
        database_url: str, conn: psycopg.AsyncConnection[Any]) -> None:
    """30 inserts of one client, each on its own connection and released together: exactly the limit are made."""
    client_id, _ = await seed.client(conn, "acme")
    start = asyncio.Event()
    ready = 0

    async def register(own_pool: AsyncConnectionPool, n: int) -> bool:
        nonlocal ready
        async with own_pool.connection() as own:
            ready += 1
            await start.wait()
            row = await ApiStore(own).webhook_endpoint_insert(
                client_id=client_id, url=f"https://h{n}.example.com/in", events=["job.completed"],
                secret=webhooks.new_secret(), max_per_client=MAX_ENDPOINTS_PER_CLIENT)
            return row is not None

    own_pool = db.make_pool(database_url, application_name="storyjobs-test", connect_timeout_s=5,
                            statement_timeout_s=30, min_size=30, max_size=30, wait_timeout_s=10)
    async with own_pool:
        tasks = [asyncio.create_task(register(own_pool, n)) for n in range(30)]
        await wait_until(lambda: ready == 30, what="30 connections held")
        start.set()
        made = await asyncio.gather(*tasks)
    assert made.count(True) == MAX_ENDPOINTS_PER_CLIENT
    assert await count(conn, "SELECT count(*) FROM webhook_endpoints") == MAX_ENDPOINTS_PER_CLIENT
