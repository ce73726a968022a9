"""The webhook endpoints of the api, in the test's event loop on a real
Postgres: what a client registers and sees, and the console's view and retry."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from api.store import ApiStore
from tests.support import ops_seed as seed
from tests.support.api_client import api_client, assert_problem
from tests.support.database import count
from worker.delivery.store import PgDeliveryStore


async def test_an_endpoint_is_created_with_its_secret_once_and_listed_without_it(
        pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]) -> None:
    """201 with a whsec_ secret and every event by default; the list never shows a secret."""
    _, key = await seed.client(conn, "acme")
    async with api_client(pool, key) as client:
        created = await client.post("/webhook-endpoints", json={"url": "https://hooks.example.com/in"})
        assert created.status_code == 201, created.text
        body = created.json()
        assert body["secret"].startswith("whsec_") and body["events"] == ["job.completed", "job.failed",
                                                                          "job.cancelled"]
        chosen = await client.post("/webhook-endpoints", json={"url": "https://hooks.example.com/failures",
                                                               "events": ["job.failed", "job.failed"]})
        assert chosen.json()["events"] == ["job.failed"]
        listed = (await client.get("/webhook-endpoints")).json()["endpoints"]
    assert [e["id"] for e in listed] == [body["id"], chosen.json()["id"]]
    assert all("secret" not in e for e in listed)


async def test_a_bad_body_or_a_full_list_is_refused_as_a_problem(
        pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]) -> None:
    """An unknown event, an extra field or no url is a 400; an eleventh endpoint a 409."""
    _, key = await seed.client(conn, "acme")
    async with api_client(pool, key) as client:
        for bad in ({"url": "https://a.example.com", "events": ["job.started"]},
                    {"url": "https://a.example.com", "secret": "mine"}, {}, {"url": "https://a.example.com",
                                                                              "events": []}):
            assert_problem(await client.post("/webhook-endpoints", json=bad), 400)
        for n in range(10):
            answer = await client.post("/webhook-endpoints", json={"url": f"https://h{n}.example.com/in"})
            assert answer.status_code == 201
        assert_problem(await client.post("/webhook-endpoints", json={"url": "https://h.example.com/in"}), 409)
    assert await count(conn, "SELECT count(*) FROM webhook_endpoints") == 10


async def test_the_console_lists_endpoints_per_client_and_retries_a_dead_delivery(
        pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]) -> None:
    """/ops/api/webhooks shows each endpoint with its client and last deliveries; retry makes a dead one due."""
    client_id, key = await seed.client(conn, "acme")
    operator = await seed.operator_key(conn)
    async with api_client(pool, key) as client:
        endpoint = (await client.post("/webhook-endpoints", json={"url": "https://hooks.example.com/in"})).json()
    job = await seed.insert_job(conn, seed.pending(client_id, 60))
    assert await ApiStore(conn).job_cancel(client_id=client_id, job_id=job.public_id) is not None
    (claimed,) = await PgDeliveryStore(conn).claim(limit=1, lease_s=60)
    await PgDeliveryStore(conn).finish(delivery_id=claimed.id, lease=claimed.lease, outcome="dead", status_code=500,
                                       error="HTTP 500")
    async with api_client(pool, operator) as console:
        listed = (await console.get("/ops/api/webhooks")).json()["endpoints"]
        (shown,) = listed
        assert (shown["id"], shown["client_name"], shown["dead"]) == (endpoint["id"], "acme", 1)
        assert shown["failing_since"] is not None and "secret" not in str(shown)
        (delivery,) = shown["last_deliveries"]
        assert (delivery["job_id"], delivery["state"], delivery["last_error"]) == (str(job.public_id), "dead",
                                                                                    "HTTP 500")
        retried = await console.post(f"/ops/api/webhooks/deliveries/{delivery['id']}/retry")
        assert retried.json() == {"id": delivery["id"], "state": "pending"}
        assert_problem(await console.post(f"/ops/api/webhooks/deliveries/{delivery['id']}/retry"), 404)
        assert (await console.get("/ops/api/webhooks", params={"client_id": client_id + 1})).json() == {
            "endpoints": []}
    assert await count(conn, "SELECT count(*) FROM webhook_deliveries WHERE state = 'pending' AND attempts = 0") == 1
