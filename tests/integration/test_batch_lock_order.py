"""The batch lane's ingest of results (batch_results_ingest) locks its
jobs' rows before their ledger rows, as every statement that writes both
does (migration 019's jobs_end): while it waits for a job that a cancel or a
sweep holds (whose next statement closes that job's ledger row), it holds no
ledger row, so the two queue behind each other instead of deadlocking."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from tests.support.database import client_id_of, count, enqueue_batch, waiting_on_a_lock
from tests.support.money import money_problems
from tests.support.waiting import wait_until
from worker.batch.rows import Lease, ResultRecord
from worker.batch.store import BatchStore

Conn = psycopg.AsyncConnection[Any]


async def test_an_ingest_waiting_for_its_job_row_holds_no_ledger_row(
    conn: Conn, pool: AsyncConnectionPool, database_url: str,
) -> None:
    """A succeeded result read while another session holds its job's row: the ingest waits for the job before
    it closes the job's ledger row, then completes the job charged what the result billed."""
    client = await client_id_of(conn)
    await enqueue_batch(conn, client, "a patient heron")
    store = BatchStore(pool)
    taken = await store.lease_take("w-1", 60.0)
    assert taken is not None
    lease = Lease("w-1", taken.token)
    intent = await store.intent_create(lease, 60.0, max_requests=10, model="claude-test", provider="anthropic")
    assert intent is not None
    (item,) = intent.items
    result = ResultRecord(custom_id=item.custom_id, result="succeeded", story_id=str(uuid.uuid4()),
                          title="The heron", body="Once upon a time.", model="claude-test", prompt_version="v1",
                          input_tokens=100, output_tokens=200, request_id="req_1")
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as holder:
        async with holder.transaction():
            await holder.execute("SELECT id FROM story_jobs WHERE id = %s FOR UPDATE", (item.job_id,))
            ingest = asyncio.ensure_future(store.ingest(lease, intent.id, [result], max_attempts=3, free=False))
            await wait_until(lambda: waiting_on_a_lock(conn), what="the ingest to wait for the held job")
            # the ledger row is free while the ingest waits (NOWAIT raises if another session holds it)
            await conn.execute("SELECT job_id FROM llm_calls WHERE job_id = %s FOR NO KEY UPDATE NOWAIT",
                               (item.job_id,))
        answer = await asyncio.wait_for(ingest, timeout=10)
    assert (answer.read, answer.completed, answer.failed) == (1, 1, 0)
    assert answer.cost_usd > 0
    cur = await conn.execute("SELECT j.status::text, j.charged_usd = c.cost_usd, c.outcome::text, c.billed "
                             "FROM story_jobs j JOIN llm_calls c ON c.job_id = j.id WHERE j.id = %s",
                             (item.job_id,))
    assert await cur.fetchall() == [("completed", True, "succeeded", True)]
    assert await count(conn, "SELECT count(*) FROM stories") == 1
    assert await money_problems(conn) == []
