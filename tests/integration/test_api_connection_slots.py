"""Requests queue for the pool's connections in the api's own slots
(api.deps.ConnectionSlots): as many at once as the pool has connections, the
others waiting at most API_DB_WAIT_S."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from api.ops.cursor import Position
from shared import db
from tests.support import ops_seed as seed
from tests.support.api_client import api_client, assert_problem, new_key
from tests.support.database import count
from tests.support.waiting import wait_until


@pytest.fixture
async def two_connections(database_url: str) -> AsyncIterator[AsyncConnectionPool]:
    """A pool of two connections, far fewer than the requests sent at once."""
    small = db.make_pool(database_url, application_name="storyjobs-test", connect_timeout_s=5,
                         statement_timeout_s=30, min_size=2, max_size=2, wait_timeout_s=5)
    await small.open(wait=True)
    yield small
    await small.close()


async def test_many_more_polls_than_connections_are_all_answered(
    two_connections: AsyncConnectionPool, api_key: str
) -> None:
    """Forty polls at once on a pool of two connections each answer 200 with the job."""
    async with api_client(two_connections, api_key) as client:
        job_url = (await client.post("/stories/generate", json={"prompt": "a fox"}, headers=new_key())
                   ).headers["location"]
        answers = await asyncio.gather(*(client.get(job_url) for _ in range(40)))
    assert [answer.status_code for answer in answers] == [200] * 40
    assert {answer.json()["status"] for answer in answers} == {"pending"}


async def test_a_request_that_finds_every_connection_taken_waits_api_db_wait_s_then_answers_503(
    two_connections: AsyncConnectionPool, api_key: str, database_url: str
) -> None:
    """With both connections held by polls blocked on a lock, a third poll answers 503 with Retry-After after
    about API_DB_WAIT_S (0.3 s), well within the request's deadline (5 s); once the lock is gone the two
    blocked polls are answered."""
    async with api_client(two_connections, api_key, api_db_wait_s=0.3, api_request_timeout_s=5.0) as client:
        job_url = (await client.post("/stories/generate", json={"prompt": "a fox"}, headers=new_key())
                   ).headers["location"]
        async with await psycopg.AsyncConnection.connect(database_url) as locker:
            await locker.execute("BEGIN")
            await locker.execute("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE")
            blocked = [asyncio.create_task(client.get(job_url)) for _ in range(2)]
            await wait_until(lambda: _sessions_waiting_on_a_lock(locker, 2),
                             what="both polls to wait on the lock")
            started = time.monotonic()
            third = await client.get(job_url)
            waited = time.monotonic() - started
            await locker.execute("ROLLBACK")
        answers = await asyncio.gather(*blocked)
    assert_problem(third, 503)
    assert int(third.headers["retry-after"]) >= 1
    assert 0.3 <= waited < 3
    assert [answer.status_code for answer in answers] == [200, 200]


async def _sessions_waiting_on_a_lock(locker: psycopg.AsyncConnection[Any], sessions: int) -> bool:
    return await count(locker, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                               "AND wait_event_type = 'Lock'") >= sessions


async def test_a_request_checks_its_key_on_the_connection_its_handler_uses(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], api_key: str
) -> None:
    """A console request, a client's action and a story read each take one connection of the pool: the key,
    an operator's or a client's, is checked on the handler's own connection, never on a second one."""
    operator_key = await seed.operator_key(conn)
    async with api_client(pool) as client:
        job_url = (await client.post("/stories/generate", json={"prompt": "a fox"}, headers={
            **new_key(), "Authorization": f"Bearer {api_key}"})).headers["location"]
        for method, url, key in (("GET", "/ops/api/overview", operator_key), ("GET", "/ops/api/jobs", operator_key),
                                 ("POST", "/ops/api/cancel-pending", operator_key),
                                 ("GET", "/webhook-endpoints", api_key), ("DELETE", job_url, api_key),
                                 ("GET", "/stories/00000000-0000-0000-0000-000000000000", api_key)):
            pool.pop_stats()
            body = {"through": Position(id=0).token()} if method == "POST" else None
            answer = await client.request(method, url, json=body, headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code in (200, 404), (url, answer.text)
            assert pool.get_stats().get("requests_num") == 1, (method, url, pool.get_stats())
