"""The rules POST /webhook-endpoints enforces, through the api's real app in
the test's event loop on a real Postgres: the URL rule, and the endpoint
limit under concurrent registrations."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from api.webhooks import MAX_ENDPOINTS_PER_CLIENT
from tests.support import ops_seed as seed
from tests.support.api_client import api_client, assert_problem
from tests.support.database import count


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
