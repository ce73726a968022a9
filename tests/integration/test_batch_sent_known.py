"""batch_sent (sql/batch.sql) adopts an intent as the provider's batch once:
a provider batch id a row of ours already records is answered with that row,
never raised nor written over, and the intent stays one to reconcile."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from tests.support.database import client_id_of, enqueue_batch
from worker.batch.rows import Lease
from worker.batch.store import BatchStore


async def test_a_batch_id_another_row_records_is_answered_with_that_row(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    client = await client_id_of(conn)
    store = BatchStore(pool)
    taken = await store.lease_take("w-1", 60.0)
    assert taken is not None
    lease = Lease("w-1", taken.token)
    intents = []
    for prompt in ("a first fox", "a second fox"):
        await enqueue_batch(conn, client, prompt)
        intent = await store.intent_create(lease, 60.0, max_requests=1, model="claude-test", provider="anthropic")
        assert intent is not None
        intents.append(intent.id)
    expires_at = datetime.now(UTC) + timedelta(hours=24)
    first = await store.sent(lease, intents[0], "msgbatch_01", expires_at, "in_progress")
    assert (first.sent, first.known_as) == (True, None)
    again = await store.sent(lease, intents[1], "msgbatch_01", expires_at, "in_progress")
    assert (again.sent, again.known_as, again.known_state, again.lease_held) == (False, intents[0], "sent", True)
    cur = await conn.execute("SELECT id, state, provider_batch_id FROM message_batches ORDER BY id")
    assert await cur.fetchall() == [(intents[0], "sent", "msgbatch_01"), (intents[1], "intent", None)]
