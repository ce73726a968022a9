"""A database that does not answer in time: 503 with Retry-After, within the
api's deadline, and back to normal as soon as it answers again."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from tests.support.api_client import api_client, assert_problem, new_key, stored_jobs


async def test_a_blocked_database_answers_503_within_the_deadline_then_recovers(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], api_key: str, database_url: str
) -> None:
    """With the tables locked by another session, POST, GET and DELETE answer 503 with Retry-After within
    API_REQUEST_TIMEOUT_S (not the 30 s statement timeout), /readyz stays up, and the lock's release ends it."""
    async with api_client(pool, api_key, api_request_timeout_s=1.0, api_db_wait_s=0.5) as client:
        accepted = await client.post("/stories/generate", json={"prompt": "a fox"}, headers=new_key())
        job_url = accepted.headers["location"]
        async with await psycopg.AsyncConnection.connect(database_url) as locker, locker.transaction():
            await locker.execute("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            answers = await asyncio.gather(
                client.post("/stories/generate", json={"prompt": "an owl"}, headers=new_key()),
                client.get(job_url),
                client.delete(job_url),
            )
            elapsed = time.monotonic() - started
            # readiness asks the server, not the locked tables
            assert (await client.get("/readyz")).status_code == 200
        for answer in answers:
            assert_problem(answer, 503)
            assert int(answer.headers["retry-after"]) >= 1
        assert elapsed < 8
        assert (await client.get(job_url)).json()["status"] == "pending"
        again = await client.post("/stories/generate", json={"prompt": "an owl"}, headers=new_key())
    assert again.status_code == 202
    assert await stored_jobs(conn) == 2
