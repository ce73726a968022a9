"""The batch lane at the api: POST /stories/generate with "lane": "batch",
its answer and its poll (lane, due_by, a Retry-After no shorter than the
lane's poll interval), its own queue (BATCH_QUEUE_MAX apart from QUEUE_MAX),
the lane in the fingerprint, and the interactive fingerprint unchanged."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from shared.story_request import StoryRequest, fingerprint
from tests.support.api_client import api_client, assert_problem, new_key
from tests.support.database import count, create_key


async def test_a_batch_job_is_accepted_with_its_lane_and_due_by_and_polled_no_faster_than_its_batches(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any],
) -> None:
    """The 202 and the poll carry lane batch and a due_by a day and a collection after its admission; the
    poll's Retry-After is at least BATCH_POLL_INTERVAL_S; the job is pending, waiting for a batch."""
    key = await create_key(conn, "parent")
    async with api_client(pool, key, batch_poll_interval_s=45.0, batch_collect_s=60.0) as client:
        answer = await client.post("/stories/generate", json={"prompt": "a sleepy whale", "lane": "batch"},
                                   headers=new_key())
        assert answer.status_code == 202, answer.text
        accepted = answer.json()
        assert accepted["lane"] == "batch" and int(answer.headers["retry-after"]) >= 45
        due_by = datetime.fromisoformat(accepted["due_by"])
        polled = await client.get(answer.headers["location"])
    state = polled.json()
    assert (state["lane"], state["status"], state["queue_position"]) == ("batch", "pending", None)
    assert int(polled.headers["retry-after"]) >= 45
    cur = await conn.execute("SELECT created_at, batch_ready_at IS NOT NULL, lane::text FROM story_jobs")
    ((created_at, waiting, lane),) = await cur.fetchall()
    assert waiting and lane == "batch"
    assert due_by == datetime.fromisoformat(state["due_by"]) == created_at + timedelta(seconds=60, hours=24)


async def test_an_interactive_job_has_no_due_by_and_keeps_its_lane(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any],
) -> None:
    """Without a lane, a job is interactive: lane interactive, due_by null, a queue position."""
    key = await create_key(conn, "parent")
    async with api_client(pool, key) as client:
        answer = await client.post("/stories/generate", json={"prompt": "a sleepy whale"}, headers=new_key())
        state = (await client.get(answer.headers["location"])).json()
    assert (answer.json()["lane"], answer.json()["due_by"]) == ("interactive", None)
    assert (state["lane"], state["due_by"], state["queue_position"]) == ("interactive", None, 1)


async def test_any_other_lane_is_refused_naming_the_two(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any],
) -> None:
    """"lane": "overnight" (or a number) is a 400 that names interactive and batch; nothing is stored."""
    key = await create_key(conn, "parent")
    async with api_client(pool, key) as client:
        for lane in ("overnight", 1, None):
            answer = await client.post("/stories/generate", json={"prompt": "a whale", "lane": lane},
                                       headers=new_key())
            problem = assert_problem(answer, 400)
            assert "lane" in str(problem), problem
            if lane == "overnight":
                assert "interactive" in problem["detail"] and "batch" in problem["detail"], problem
    assert await count(conn, "SELECT count(*) FROM story_jobs") == 0


async def test_the_same_key_with_the_other_lane_is_a_reused_key(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any],
) -> None:
    """A key used for an interactive story and sent again for the batch lane answers 422: another request."""
    key = await create_key(conn, "parent")
    idempotency = new_key()
    async with api_client(pool, key) as client:
        first = await client.post("/stories/generate", json={"prompt": "a whale"}, headers=idempotency)
        again = await client.post("/stories/generate", json={"prompt": "a whale", "lane": "batch"},
                                  headers=idempotency)
        same = await client.post("/stories/generate", json={"prompt": "a whale", "lane": "interactive"},
                                 headers=idempotency)
    assert first.status_code == 202
    assert_problem(again, 422)
    assert same.status_code == 202 and same.headers["idempotent-replayed"] == "true"


def test_an_interactive_request_keeps_the_fingerprint_it_had_before_the_lane_existed() -> None:
    """The canonical form of an interactive request leaves the lane out, so a key stored before the lane was
    added still matches its request; a batch request's includes it."""
    interactive = StoryRequest(prompt="a whale", age=5)
    before_the_lane = (b'{"age":5,"child_name":null,"language":"en","length":"medium","prompt":"a whale"}')
    import hashlib
    assert fingerprint(interactive) == hashlib.sha256(before_the_lane).digest()
    assert fingerprint(StoryRequest(prompt="a whale", age=5, lane="batch")) != fingerprint(interactive)


async def test_the_batch_queue_is_bounded_apart_from_the_interactive_queue(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any],
) -> None:
    """With QUEUE_MAX=2 and BATCH_QUEUE_MAX=3, 6 concurrent batch POSTs store 3 (the rest 429
    batch_queue_full), and 2 interactive ones are still admitted beside them."""
    key = await create_key(conn, "parent")
    async with api_client(pool, key, queue_max=2, client_queue_max=2, batch_queue_max=3,
                          client_batch_queue_max=3) as client:
        async def post(lane: str) -> Any:
            return await client.post("/stories/generate", json={"prompt": "a whale", "lane": lane},
                                     headers=new_key())
        batch = await asyncio.gather(*(post("batch") for _ in range(6)))
        interactive = await asyncio.gather(*(post("interactive") for _ in range(2)))
    assert sorted(a.status_code for a in batch) == [202] * 3 + [429] * 3
    for refused in (a for a in batch if a.status_code == 429):
        assert "batch queue is full" in assert_problem(refused, 429)["detail"]
    assert [a.status_code for a in interactive] == [202, 202]
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE lane = 'batch'") == 3


async def test_batch_jobs_running_in_their_batch_still_count_against_the_batch_queue(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any],
) -> None:
    """BATCH_QUEUE_MAX bounds all clients' batch jobs not yet ended, in a batch or waiting for one: with
    BATCH_QUEUE_MAX=2 and one client's two jobs running in their batch, another client is refused,
    alone or with others at once."""
    bounds: dict[str, Any] = {"batch_queue_max": 2, "client_batch_queue_max": 2}

    def post(client: Any) -> Any:
        return client.post("/stories/generate", json={"prompt": "a whale", "lane": "batch"}, headers=new_key())

    async with api_client(pool, await create_key(conn, "first"), **bounds) as client:
        assert [(await post(client)).status_code for _ in range(2)] == [202, 202]
    # what the lane does once their batch is made: running, owned by the batch
    cur = await conn.execute("INSERT INTO message_batches (state, request_count, model) VALUES ('intent', 2, 'm') "
                             "RETURNING id")
    (batch_id,) = await cur.fetchone() or (None,)
    await conn.execute("UPDATE story_jobs SET status = 'running', started_at = now(), heartbeat_at = now(), "
                       "batch_id = %s, batch_ready_at = NULL, worker_id = 'batch-' || %s "
                       "WHERE lane = 'batch'", (batch_id, batch_id))
    async with api_client(pool, await create_key(conn, "second"), **bounds) as client:
        refused = [await post(client), *await asyncio.gather(*(post(client) for _ in range(3)))]
    assert [answer.status_code for answer in refused] == [429] * 4
    assert "batch queue is full" in assert_problem(refused[0], 429)["detail"]
