"""The offline writer (no ANTHROPIC_API_KEY: demos and tests) calls no
model, so the stories it writes cost nothing (its price is shared.pricing's
FREE): the ledger records their tokens at no charge, and no budget is spent
on them."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from shared.ratelimit import NO_LIMITS
from tests.support.database import client_id_of, enqueue, job_rows
from tests.support.settings import worker_settings
from tests.support.waiting import wait_until
from worker.coordinator import Coordinator
from worker.offline import OfflineWriter
from worker.pg_store import PgWorkerStore


async def test_a_story_the_offline_writer_writes_costs_nothing(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    """Whatever prices the job was admitted at, its offline call is recorded with its tokens and a charge of
    0, and the day's spend stays 0."""
    await enqueue(conn, await client_id_of(conn), "an owl who counts the stars")
    settings = worker_settings()
    writer = OfflineWriter(0)
    store = PgWorkerStore(pool, worker_id="w-offline", provider=writer.provider, model=writer.model,
                          default_max_tokens=settings.llm_max_tokens)
    await store.ensure_rate_bucket(NO_LIMITS)
    worker = Coordinator(settings, store, writer, listen=False)
    assert (await worker.round_once()).claimed == 1
    await wait_until(lambda: all(not h.running for h in worker.held), what="the story to be written")
    assert (await worker.round_once()).completed == 1
    assert [row.status for row in await job_rows(conn)] == ["completed"]
    cur = await conn.execute("SELECT input_usd_per_mtok, output_usd_per_mtok FROM story_jobs")
    prices = await cur.fetchone()
    assert prices is not None and all(price > 0 for price in prices)
    cur = await conn.execute("SELECT outcome, billed, input_tokens, output_tokens, cost_usd FROM llm_calls")
    (outcome, billed, input_tokens, output_tokens, cost_usd), = await cur.fetchall()
    assert (outcome, billed) == ("succeeded", True)
    assert input_tokens > 0 and output_tokens > 0 and cost_usd == Decimal(0)
    cur = await conn.execute("SELECT coalesce(sum(spent_usd), 0), coalesce(sum(reserved_usd), 0) FROM budget_days")
    assert await cur.fetchone() == (Decimal(0), Decimal(0))
