"""Admissions are written in batches, strictly bounded and deduplicated."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from api.admission import AdmissionBatcher, admission
from api.rows import Admission
from shared.config import ApiSettings
from shared.story_request import StoryRequest
from tests.support.database import client_id_of, count


def _admission(client_id: int, key: str, prompt: str = "a fox") -> Admission:
    return admission(client_id, key, StoryRequest(prompt=prompt), ApiSettings())


async def test_concurrent_admissions_share_transactions(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """40 admissions at once are all stored, in fewer transactions than admissions."""
    client = await client_id_of(conn)
    batcher = AdmissionBatcher(pool, queue_max=1000, client_queue_max=1000,
                               batch_queue_max=100, client_batch_queue_max=100, connection_wait_s=5)
    results = await asyncio.gather(*(batcher.admit(_admission(client, f"key-{n}")) for n in range(40)))
    assert [r.outcome for r in results] == ["inserted"] * 40
    assert len({r.public_id for r in results}) == 40
    assert 1 <= batcher.batches_written < 40
    assert await count(conn, "SELECT count(*) FROM story_jobs") == 40


async def test_one_key_twice_in_a_batch_is_one_job(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The same key sent twice at once makes one job; the second answer is a replay of it."""
    client = await client_id_of(conn)
    batcher = AdmissionBatcher(pool, queue_max=1000, client_queue_max=1000,
                               batch_queue_max=100, client_batch_queue_max=100, connection_wait_s=5)
    first, second = await asyncio.gather(batcher.admit(_admission(client, "same")),
                                         batcher.admit(_admission(client, "same")))
    assert (first.outcome, second.outcome) == ("inserted", "existing")
    assert first.public_id == second.public_id
    assert await count(conn, "SELECT count(*) FROM story_jobs") == 1


async def test_a_batch_is_admitted_in_order_up_to_each_bound(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any]
) -> None:
    """With room for 3 per client and 4 in all, a batch from two clients admits each client's first
    three, then stops at four in all; the refusals say which queue was full."""
    alice = await client_id_of(conn, "alice")
    bob = await client_id_of(conn, "bob")
    batcher = AdmissionBatcher(pool, queue_max=4, client_queue_max=3,
                               batch_queue_max=100, client_batch_queue_max=100, connection_wait_s=5)
    asked = [(alice, "a1"), (alice, "a2"), (alice, "a3"), (alice, "a4"), (bob, "b1"), (bob, "b2")]
    results = await asyncio.gather(*(batcher.admit(_admission(c, k)) for c, k in asked))
    outcomes = [r.outcome for r in results]
    assert outcomes.count("inserted") == 4
    assert outcomes[3] == "client_queue_full"
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE status = 'pending'") == 4
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE client_id = %s", alice) <= 3


async def _admit(conn: psycopg.AsyncConnection[Any], client: int, keys: list[str], *, queue_max: int,
                 client_queue_max: int | None = None) -> list[str]:
    from api.store import ApiStore

    results = await ApiStore(conn).job_insert_if_admitted(
        admissions=[_admission(client, key) for key in keys], queue_max=queue_max,
        client_queue_max=client_queue_max or queue_max)
    return [r.outcome for r in results]


async def _pending(conn: psycopg.AsyncConnection[Any]) -> int:
    return await count(conn, "SELECT count(*) FROM story_jobs WHERE status = 'pending'")


async def test_a_replica_with_a_smaller_limit_never_lowers_the_bound_below_the_truth(
    conn: psycopg.AsyncConnection[Any]
) -> None:
    """During a deploy that changes QUEUE_MAX, a replica with 5 that finds the queue full (at its limit)
    leaves the kept bound alone, so a replica with 8 never admits past 8; the same for a client's queue."""
    client = await client_id_of(conn)
    assert await _admit(conn, client, [f"big-{n}" for n in range(8)], queue_max=8) == ["inserted"] * 8
    assert await _admit(conn, client, ["small"], queue_max=5) == ["client_queue_full"]
    assert await _admit(conn, client, ["small-all"], queue_max=5, client_queue_max=3) == ["client_queue_full"]
    assert await _admit(conn, client, ["big-9"], queue_max=8) == ["client_queue_full"]
    other = await client_id_of(conn, "other")
    assert await _admit(conn, other, ["other-small"], queue_max=5) == ["queue_full"]
    assert await _admit(conn, other, ["other-big"], queue_max=8) == ["queue_full"]
    assert await _pending(conn) == 8
    assert await count(conn, "SELECT min(pending_at_most) FROM job_admission WHERE client_id IN (0, %s)",
                       client) >= 8


async def test_a_missing_bound_row_is_recreated_and_admission_stays_exact(conn: psycopg.AsyncConnection[Any]) -> None:
    """An operator who deletes job_admission's rows loses nothing: a batch of replays answers, the next
    admissions count the queue and keep a bound again, and the limit holds exactly."""
    client = await client_id_of(conn)
    assert await _admit(conn, client, ["a", "b", "c"], queue_max=5) == ["inserted"] * 3
    await conn.execute("DELETE FROM job_admission")
    assert await _admit(conn, client, ["a"], queue_max=5) == ["existing"]
    await conn.execute("DELETE FROM job_admission")
    assert await _admit(conn, client, ["d", "e", "f"], queue_max=5) == ["inserted", "inserted", "client_queue_full"]
    assert await _pending(conn) == 5
    assert await count(conn, "SELECT count(*) FROM job_admission WHERE pending_at_most >= 5") == 2
