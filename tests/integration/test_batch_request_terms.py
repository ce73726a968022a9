"""A batch request is sent on its job's own terms (worker.batch.submitter
_requests): the max_tokens the job was admitted with, which its reservation
assumed, not the worker's LLM_MAX_TOKENS; so a batch never bills a job more
than admission reserved for it."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from tests.fakes.anthropic_batches import FakeBatches
from tests.support.database import client_id_of, enqueue_batch
from tests.support.settings import worker_settings
from worker.batch.anthropic_batches import AnthropicBatches
from worker.batch.lane import BatchLane
from worker.batch.store import BatchStore


async def test_a_batch_request_carries_its_jobs_own_max_tokens(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """Two jobs admitted with 700 and 2,400 max_tokens, a worker whose LLM_MAX_TOKENS is 1,600: each request
    asks for its job's own."""
    client = await client_id_of(conn)
    for prompt in ("a short owl", "a long owl"):
        await enqueue_batch(conn, client, prompt)
    await conn.execute("UPDATE story_jobs SET max_tokens = CASE request->>'prompt' WHEN 'a short owl' THEN 700 "
                       "ELSE 2400 END")
    settings = worker_settings(batch_collect_s=1.0, batch_poll_interval_s=1.0, anthropic_api_key="test",
                               llm_max_tokens=1600)
    lane = BatchLane(settings, BatchStore(pool), provider, holder="w-1")
    assert (await lane.tick_once()).submitted == 2
    (batch,) = fake.batches
    asked = [(str(item.params["messages"][0]["content"]), item.params["max_tokens"]) for item in batch.items]
    by_prompt = {("short" if "a short owl" in text else "long"): tokens for text, tokens in asked}
    assert by_prompt == {"short": 700, "long": 2400}
