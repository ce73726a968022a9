"""The operators' audit trail: each console action writes one operator_actions
row in its own transaction (who, what, on what, how many it changed), and
/ops/api/actions lists them newest first."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from shared import keys
from tests.support import ops_seed as seed
from tests.support.api_client import api_client, assert_problem

OPS = "/ops/api"
Conn = psycopg.AsyncConnection[Any]


async def _recorded(conn: Conn) -> list[tuple[Any, ...]]:
    cur = await conn.execute("SELECT k.name, a.action, a.job_id::text, a.filter, a.touched FROM operator_actions a "
                             "JOIN operator_keys k ON k.id = a.operator_key_id ORDER BY a.id")
    return await cur.fetchall()


async def test_every_console_action_is_recorded_with_its_operator_target_and_count(
    pool: AsyncConnectionPool, conn: Conn
) -> None:
    """Cancelling a job (and trying again), cancelling by filter, revoking a client's keys and one key, and
    setting a client's weight each write a row naming the operator's key, the job or the filter as sent, and
    what it changed; the endpoint lists them newest first, in pages."""
    acme, _ = await seed.client(conn, "acme")
    globex, globex_key = await seed.client(conn, "globex")
    one, two, three = await seed.insert_jobs(conn, [seed.pending(acme, 30), seed.pending(acme, 20),
                                                    seed.pending(globex, 10)])
    ada = await seed.operator_key(conn, "ada")
    bob = await seed.operator_key(conn, "bob")
    async with api_client(pool, ada) as client:
        assert (await client.post(f"{OPS}/jobs/{one.public_id}/cancel")).status_code == 200
        assert_problem(await client.post(f"{OPS}/jobs/{one.public_id}/cancel"), 409)
        counted = (await client.get(f"{OPS}/cancel-pending", params={"client_id": acme})).json()
        done = await client.post(f"{OPS}/cancel-pending", json={"client_id": acme, "through": counted["through"]})
        assert done.json()["cancelled"] == 1
    async with api_client(pool, bob) as client:
        assert (await client.post(f"{OPS}/clients/{globex}/revoke-keys")).status_code == 200
        assert_problem(await client.post(f"{OPS}/keys/{keys.prefix_of(globex_key)}/revoke"), 404)
        assert (await client.put(f"{OPS}/clients/{globex}/weight", json={"weight": 3})).json() == {"weight": 3}
        listed = (await client.get(f"{OPS}/actions")).json()["actions"]
        older = (await client.get(f"{OPS}/actions", params={"before_id": listed[1]["id"], "limit": 2})).json()

    assert await _recorded(conn) == [
        ("ada", "job_cancel", str(one.public_id), None, 1),
        ("ada", "job_cancel", str(one.public_id), None, 0),
        ("ada", "pending_cancel", None, {"client_id": acme, "created_after": None, "created_before": None,
                                         "through": counted["through"]}, 1),
        ("bob", "client_keys_revoke", None, {"client_id": globex}, 1),
        ("bob", "client_weight_set", None, {"client_id": globex, "weight": 3}, 1),
    ]
    assert [(a["operator"], a["action"], a["touched"]) for a in listed] == [
        ("bob", "client_weight_set", 1), ("bob", "client_keys_revoke", 1), ("ada", "pending_cancel", 1), ("ada", "job_cancel", 0),
        ("ada", "job_cancel", 1)]
    assert listed[1]["operator_key_prefix"] == keys.prefix_of(bob) and listed[1]["filter"] == {"client_id": globex}
    assert listed[4]["job_id"] == str(one.public_id)
    assert [a["id"] for a in older["actions"]] == [listed[2]["id"], listed[3]["id"]]
    assert two and three


async def test_an_action_whose_record_cannot_be_written_does_not_happen(pool: AsyncConnectionPool, conn: Conn) -> None:
    """With operator_actions refusing every row, a cancel by an operator fails and the job stays pending: the
    record and the action commit together or not at all."""
    acme, _ = await seed.client(conn, "acme")
    job = await seed.insert_job(conn, seed.pending(acme, 10))
    await conn.execute("ALTER TABLE operator_actions ADD CONSTRAINT refuse_all CHECK (false) NOT VALID")
    async with api_client(pool, await seed.operator_key(conn, "ada")) as client:
        answer = await client.post(f"{OPS}/jobs/{job.public_id}/cancel")
    assert answer.status_code >= 500
    cur = await conn.execute("SELECT status::text FROM story_jobs WHERE id = %s", (job.id,))
    assert await cur.fetchone() == ("pending",)


async def _dead_delivery(conn: Conn) -> tuple[int, str]:
    """A dead delivery of a cancelled job: (its id, the job's public id)."""
    acme, _ = await seed.client(conn, "acme")
    await conn.execute("INSERT INTO webhook_endpoints (client_id, url, events, secret) "
                       "VALUES (%s, 'https://hooks.example.com/in', '{job.cancelled}', 'whsec_x')", (acme,))
    job = await seed.insert_job(conn, seed.pending(acme, 10))
    await conn.execute("UPDATE story_jobs SET status = 'failed', error_code = 'cancelled', completed_at = now() "
                       "WHERE id = %s", (job.id,))
    cur = await conn.execute("UPDATE webhook_deliveries SET state = 'dead', attempts = 8 RETURNING id")
    (delivery_id,) = await cur.fetchone() or (0,)
    return delivery_id, str(job.public_id)


async def test_a_delivery_retried_from_the_console_is_recorded_with_its_job(pool: AsyncConnectionPool, conn: Conn) -> None:
    """Retrying a dead delivery writes a retry_delivery row naming the operator, the job and the delivery; a
    retry that finds no dead delivery (404) writes none."""
    delivery_id, job_id = await _dead_delivery(conn)
    async with api_client(pool, await seed.operator_key(conn, "ada")) as client:
        assert (await client.post(f"{OPS}/webhooks/deliveries/{delivery_id}/retry")).status_code == 200
        assert_problem(await client.post(f"{OPS}/webhooks/deliveries/{delivery_id}/retry"), 404)
        listed = (await client.get(f"{OPS}/actions")).json()["actions"]
    assert await _recorded(conn) == [("ada", "retry_delivery", job_id, {"delivery_id": delivery_id}, 1)]
    assert [(a["action"], a["job_id"]) for a in listed] == [("retry_delivery", job_id)]


async def test_a_delivery_retry_whose_record_cannot_be_written_does_not_happen(
        pool: AsyncConnectionPool, conn: Conn) -> None:
    """With operator_actions refusing every row, the console's retry fails and the delivery stays dead."""
    delivery_id, _ = await _dead_delivery(conn)
    await conn.execute("ALTER TABLE operator_actions ADD CONSTRAINT refuse_all CHECK (false) NOT VALID")
    async with api_client(pool, await seed.operator_key(conn, "ada")) as client:
        answer = await client.post(f"{OPS}/webhooks/deliveries/{delivery_id}/retry")
    assert answer.status_code >= 500
    cur = await conn.execute("SELECT state, attempts FROM webhook_deliveries WHERE id = %s", (delivery_id,))
    assert await cur.fetchone() == ("dead", 8)
