"""The Idempotency-Key contract: one key, one job, whatever the concurrency."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from tests.support.api_client import api_client, assert_problem, new_key, stored_jobs
from tests.support.database import count


async def test_fifty_concurrent_posts_with_one_key_make_one_job(
    pool: AsyncConnectionPool, api_key: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """50 concurrent POSTs with one Idempotency-Key: one row, and every answer is 202 with its job_id."""
    async with api_client(pool, api_key) as client:
        answers = await asyncio.gather(*(
            client.post("/stories/generate", json={"prompt": "a fox"}, headers={"Idempotency-Key": "same"})
            for _ in range(50)))
    assert {answer.status_code for answer in answers} == {202}
    assert len({answer.json()["job_id"] for answer in answers}) == 1
    assert sum(answer.headers.get("idempotent-replayed") == "true" for answer in answers) == 49
    assert await stored_jobs(conn) == 1


async def test_fifty_concurrent_posts_against_queue_max_eight_accept_exactly_eight(
    pool: AsyncConnectionPool, api_key: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """50 concurrent POSTs with distinct keys and QUEUE_MAX=8: exactly 8 accepted, 42 refused with Retry-After."""
    async with api_client(pool, api_key, queue_max=8) as client:
        answers = await asyncio.gather(*(
            client.post("/stories/generate", json={"prompt": f"story {n}"}, headers=new_key()) for n in range(50)))
    statuses = [answer.status_code for answer in answers]
    assert statuses.count(202) == 8 and statuses.count(429) == 42
    for answer in answers:
        if answer.status_code == 429:
            assert_problem(answer, 429)
            assert int(answer.headers["retry-after"]) >= 1
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE status = 'pending'") == 8


async def test_same_key_with_another_body_is_422_and_stores_nothing(
    pool: AsyncConnectionPool, api_key: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The same Idempotency-Key with a different body is 422; the first job is unchanged."""
    async with api_client(pool, api_key) as client:
        first = await client.post("/stories/generate", json={"prompt": "a fox"}, headers={"Idempotency-Key": "k"})
        other = await client.post("/stories/generate", json={"prompt": "an owl"}, headers={"Idempotency-Key": "k"})
    assert first.status_code == 202
    assert "Idempotency-Key" in assert_problem(other, 422)["detail"]
    assert await stored_jobs(conn) == 1


async def test_key_order_whitespace_and_spelt_out_defaults_are_the_same_body(
    pool: AsyncConnectionPool, api_key: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Bodies that differ only in key order, whitespace, spelt-out defaults or the spelling of a number replay
    the job; the stored fingerprint is SHA-256 of the canonical body."""
    bodies = [
        b'{"prompt": "a fox", "age": 5}',
        b'{ "age":5,\n\t"prompt":"a fox" }',
        b'{"language": "en", "length": "medium", "prompt": "a fox", "age": 5, "child_name": null}',
        b'{"prompt": "a fox", "age": 5.0}',
    ]
    async with api_client(pool, api_key) as client:
        answers = [await client.post("/stories/generate", content=body,
                                     headers={"Idempotency-Key": "k", "Content-Type": "application/json"})
                   for body in bodies]
    assert [answer.status_code for answer in answers] == [202] * 4
    assert len({answer.json()["job_id"] for answer in answers}) == 1
    canonical = b'{"age":5,"child_name":null,"language":"en","length":"medium","prompt":"a fox"}'
    cur = await conn.execute("SELECT request_fingerprint FROM story_jobs")
    assert await cur.fetchall() == [(hashlib.sha256(canonical).digest(),)]


async def test_a_refused_post_can_be_retried_with_the_same_key(
    pool: AsyncConnectionPool, api_key: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A 429 stores nothing, so the same key is accepted once there is room."""
    async with api_client(pool, api_key, queue_max=1) as client:
        first = await client.post("/stories/generate", json={"prompt": "first"}, headers=new_key())
        refused = await client.post("/stories/generate", json={"prompt": "second"}, headers={"Idempotency-Key": "k2"})
        assert refused.status_code == 429 and await stored_jobs(conn) == 1
        assert (await client.delete(first.headers["location"])).status_code == 200
        retried = await client.post("/stories/generate", json={"prompt": "second"}, headers={"Idempotency-Key": "k2"})
    assert retried.status_code == 202 and "idempotent-replayed" not in retried.headers
