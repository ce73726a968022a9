"""One client never sees another's jobs or stories: theirs are the same 404 as
ids that do not exist."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from tests.support.api_client import api_client, assert_problem, completed_job, new_key
from tests.support.database import create_key, job_rows


async def test_another_clients_job_and_story_are_the_same_404_as_unknown_ones(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    """Client B asking for client A's completed job, its story (by story id) or cancelling it gets exactly the
    answer an unknown id gets, while A reads both."""
    alice, bob = await create_key(conn, "alice"), await create_key(conn, "bob")
    async with api_client(pool, alice) as as_alice, api_client(pool, bob) as as_bob:
        job = await completed_job(as_alice, pool, database_url, "a lighthouse keeper's cat")
        story_id = job["story"]["story_id"]
        story = await as_alice.get(f"/stories/{story_id}")
        assert story.status_code == 200 and story.headers["cache-control"] == "no-store"
        assert (await as_alice.get(f"/stories/jobs/{job['job_id']}")).headers["cache-control"] == "private, no-cache"

        for method, theirs, unknown in [
            ("GET", f"/stories/jobs/{job['job_id']}", f"/stories/jobs/{uuid.uuid4()}"),
            ("DELETE", f"/stories/jobs/{job['job_id']}", f"/stories/jobs/{uuid.uuid4()}"),
            ("GET", f"/stories/{story_id}", f"/stories/{uuid.uuid4()}"),
            ("GET", f"/stories/{job['job_id']}", f"/stories/{uuid.uuid4()}"),
        ]:
            their_answer = await as_bob.request(method, theirs)
            unknown_answer = await as_bob.request(method, unknown)
            assert assert_problem(their_answer, 404) == assert_problem(unknown_answer, 404), (method, theirs)
            assert their_answer.headers == unknown_answer.headers
    (row,) = await job_rows(conn)
    assert row.status == "completed"


async def test_a_pending_job_of_another_client_cannot_be_seen_or_cancelled(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """B's GET and DELETE on A's pending job are 404 and leave it pending."""
    alice, bob = await create_key(conn, "alice"), await create_key(conn, "bob")
    async with api_client(pool, alice) as as_alice, api_client(pool, bob) as as_bob:
        accepted = await as_alice.post("/stories/generate", json={"prompt": "a fox"}, headers=new_key())
        job_url = accepted.headers["location"]
        assert_problem(await as_bob.get(job_url), 404)
        assert_problem(await as_bob.delete(job_url), 404)
        assert (await as_alice.get(job_url)).json()["status"] == "pending"


async def test_the_same_idempotency_key_from_two_clients_makes_two_jobs(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Idempotency-Keys are per client: B reusing A's key gets a job of its own, never A's."""
    alice, bob = await create_key(conn, "alice"), await create_key(conn, "bob")
    async with api_client(pool, alice) as as_alice, api_client(pool, bob) as as_bob:
        theirs = await as_alice.post("/stories/generate", json={"prompt": "a fox"}, headers={"Idempotency-Key": "k"})
        mine = await as_bob.post("/stories/generate", json={"prompt": "an owl"}, headers={"Idempotency-Key": "k"})
    assert theirs.status_code == mine.status_code == 202
    assert mine.json()["job_id"] != theirs.json()["job_id"] and "idempotent-replayed" not in mine.headers
    assert len(await job_rows(conn)) == 2
