"""QUEUE_MAX and CLIENT_QUEUE_MAX hold exactly under concurrent POSTs, counted
in the database."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import psycopg
from psycopg_pool import AsyncConnectionPool

from tests.support.api_client import api_client, assert_problem, new_key
from tests.support.database import count, create_key


async def _post_interleaved(pool: AsyncConnectionPool, keys: dict[str, int], **settings: Any
                            ) -> list[tuple[str, httpx.Response]]:
    """POSTs from every client at once, interleaved: ``keys`` maps an API key to its number of POSTs."""
    async with api_client(pool, **settings) as client:
        async def post(key: str, n: int) -> tuple[str, httpx.Response]:
            return key, await client.post("/stories/generate", json={"prompt": f"story {n}"},
                                          headers={"Authorization": f"Bearer {key}", **new_key()})

        order = sorted(((key, n) for key, total in keys.items() for n in range(total)), key=lambda kn: kn[1])
        return await asyncio.gather(*(post(key, n) for key, n in order))


async def _pending_by_client(conn: psycopg.AsyncConnection[Any]) -> dict[str, int]:
    cur = await conn.execute(
        "SELECT c.name, count(*) FROM story_jobs j JOIN api_clients c ON c.id = j.client_id "
        "WHERE j.status = 'pending' GROUP BY c.name")
    return {name: total for name, total in await cur.fetchall()}


def _check_refusals(answers: list[tuple[str, httpx.Response]]) -> None:
    for _, answer in answers:
        if answer.status_code != 202:
            assert_problem(answer, 429)
            assert int(answer.headers["retry-after"]) >= 1


async def test_hundred_posts_from_two_clients_never_overshoot_either_queue(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """100 parallel POSTs (60 from one client, 40 from another) against QUEUE_MAX=30 and CLIENT_QUEUE_MAX=20:
    exactly 30 jobs stored, at most 20 of either client, and the answers agree with the table."""
    alice, bob = await create_key(conn, "alice"), await create_key(conn, "bob")
    answers = await _post_interleaved(pool, {alice: 60, bob: 40}, queue_max=30, client_queue_max=20)
    _check_refusals(answers)
    pending = await _pending_by_client(conn)
    assert sum(pending.values()) == 30
    assert all(total <= 20 for total in pending.values()), pending
    accepted = {answer.json()["job_id"] for _, answer in answers if answer.status_code == 202}
    cur = await conn.execute("SELECT public_id::text FROM story_jobs")
    assert accepted == {row[0] for row in await cur.fetchall()}


async def test_hundred_posts_from_two_clients_fill_each_client_queue_exactly(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """100 parallel POSTs, 50 per client, with CLIENT_QUEUE_MAX=5 and room in QUEUE_MAX: exactly 5 jobs each;
    the other 90 are 429 saying whose queue is full."""
    alice, bob = await create_key(conn, "alice"), await create_key(conn, "bob")
    answers = await _post_interleaved(pool, {alice: 50, bob: 50}, queue_max=100, client_queue_max=5)
    _check_refusals(answers)
    assert await _pending_by_client(conn) == {"alice": 5, "bob": 5}
    refused = [answer for _, answer in answers if answer.status_code == 429]
    assert len(refused) == 90 and all("your queue" in answer.json()["detail"] for answer in refused)


async def test_a_full_client_queue_leaves_room_for_another_client(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """One client at CLIENT_QUEUE_MAX gets 429 while another client's POST is still accepted."""
    alice, bob = await create_key(conn, "alice"), await create_key(conn, "bob")
    async with api_client(pool, queue_max=10, client_queue_max=2) as client:
        for _ in range(2):
            await client.post("/stories/generate", json={"prompt": "a fox"},
                              headers={"Authorization": f"Bearer {alice}", **new_key()})
        refused = await client.post("/stories/generate", json={"prompt": "a fox"},
                                    headers={"Authorization": f"Bearer {alice}", **new_key()})
        accepted = await client.post("/stories/generate", json={"prompt": "a fox"},
                                     headers={"Authorization": f"Bearer {bob}", **new_key()})
    assert refused.status_code == 429 and accepted.status_code == 202


async def test_admission_counts_again_once_jobs_have_left_the_queue(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], api_key: str
) -> None:
    """With QUEUE_MAX=3, a full queue answers 429; once two jobs are claimed the next two are
    admitted (a fresh count corrects the kept upper bound), then the queue is full again."""
    from tests.support import worker_statements

    async with api_client(pool, api_key, queue_max=3) as client:
        async def post() -> int:
            answer = await client.post("/stories/generate", json={"prompt": "a fox"}, headers=new_key())
            return answer.status_code

        assert [await post() for _ in range(4)] == [202, 202, 202, 429]
        claimed = await worker_statements.job_claim(conn, worker_id="w", claim_limit=2,
                                                   provider="offline", model="m")
        assert len(claimed.claimed) == 2
        assert [await post() for _ in range(3)] == [202, 202, 429]
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE status = 'pending'") == 3


async def test_with_the_default_client_queue_a_polite_client_is_admitted_while_a_greedy_one_hammers(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """QUEUE_MAX=8 and CLIENT_QUEUE_MAX unset: a client re-posting 40 times holds half the queue at most, and
    another client's single POST is accepted."""
    greedy, polite = await create_key(conn, "greedy"), await create_key(conn, "polite")
    async with api_client(pool, queue_max=8, client_queue_max=None) as client:
        async def post(key: str) -> httpx.Response:
            return await client.post("/stories/generate", json={"prompt": "a fox"},
                                     headers={"Authorization": f"Bearer {key}", **new_key()})

        hammered = [await post(greedy) for _ in range(20)]
        polite_answer = await post(polite)
        hammered += [await post(greedy) for _ in range(20)]
    assert polite_answer.status_code == 202, polite_answer.text
    assert sum(a.status_code == 202 for a in hammered) == 4
    for answer in hammered[4:]:
        assert_problem(answer, 429)
        assert "your queue" in answer.json()["detail"]
    assert await _pending_by_client(conn) == {"greedy": 4, "polite": 1}


async def test_a_client_above_a_lowered_client_queue_keeps_its_jobs_and_is_refused_until_under_it(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Six jobs admitted under CLIENT_QUEUE_MAX=8 stay pending when the default (4 of 8) takes over; the client's
    next POST is a 429 of its own queue until claims bring it under 4."""
    alice = await create_key(conn, "alice")
    async with api_client(pool, queue_max=8, client_queue_max=8) as client:
        for _ in range(6):
            answer = await client.post("/stories/generate", json={"prompt": "a fox"},
                                       headers={"Authorization": f"Bearer {alice}", **new_key()})
            assert answer.status_code == 202
    async with api_client(pool, queue_max=8, client_queue_max=None) as client:
        refused = await client.post("/stories/generate", json={"prompt": "a fox"},
                                    headers={"Authorization": f"Bearer {alice}", **new_key()})
        assert_problem(refused, 429)
        assert "your queue" in refused.json()["detail"]
        assert await _pending_by_client(conn) == {"alice": 6}
        # three are claimed: 3 pending, under 4
        await conn.execute("UPDATE story_jobs SET status = 'running', started_at = now(), heartbeat_at = now(), "
                           "worker_id = 'w' WHERE id IN (SELECT id FROM story_jobs ORDER BY id LIMIT 3)")
        admitted = await client.post("/stories/generate", json={"prompt": "a fox"},
                                     headers={"Authorization": f"Bearer {alice}", **new_key()})
        assert admitted.status_code == 202, admitted.text
