"""batch_intent_items (sql/batch.sql) writes each job's item and ledger row
once: run again for the same intent, it answers the items already written
and adds none, so no job of a batch gets a second request, nor a second
worst case held for it."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from shared.queries import QUERIES as Q
from tests.support.database import client_id_of, count, enqueue_batch
from worker.batch.store import BatchStore


@pytest.mark.parametrize("jobs", [1, 3])
async def test_the_items_of_an_intent_written_again_are_answered_not_written_twice(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, jobs: int,
) -> None:
    client = await client_id_of(conn)
    for n in range(jobs):
        await enqueue_batch(conn, client, f"a patient owl {n}")
    taken = await BatchStore(pool).lease_take("w-1", 60.0)
    assert taken is not None
    fence = {"holder": "w-1", "token": taken.token}
    cur = await conn.execute(Q["batch_intent_create"], {**fence, "lease_s": 60.0, "max_requests": 10,
                                                        "model": "claude-test"})
    row = await cur.fetchone()
    assert row is not None
    batch_id, _, job_ids = row
    assert len(job_ids) == jobs
    answers = []
    for _ in range(2):
        cur = await conn.execute(Q["batch_intent_items"], {**fence, "batch_id": batch_id, "job_ids": job_ids,
                                                           "model": "claude-test", "provider": "anthropic"})
        answers.append(await cur.fetchone())
    assert answers[0] == answers[1]
    assert await count(conn, "SELECT count(*) FROM message_batch_items") == jobs
    assert await count(conn, "SELECT count(*) FROM llm_calls") == jobs
