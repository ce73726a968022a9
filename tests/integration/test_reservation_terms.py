"""A job is run on the terms its reservation assumed (model, prices,
max_tokens), whatever the worker's own settings say, as on a rolling deploy
that changes them; a charge passes its reservation only when the provider
reports more usage than admission bounded, and then the difference is
counted."""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import psycopg
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from api.admission import admission
from api.store import ApiStore
from shared import prompt
from shared.pricing import Price
from shared.story_request import StoryRequest
from sweeper.store import PgSweeperStore
from sweeper.sweep import Sweeper
from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer, Plan
from tests.support.database import client_id_of, job_rows
from tests.support.settings import api_settings, sweeper_settings, worker_settings
from tests.support.waiting import wait_until
from tests.support.workers import running_worker
from worker.anthropic_writer import AnthropicWriter

Conn = psycopg.AsyncConnection[Any]
# what the api accepted the job under, and what the worker was later deployed with
API = api_settings(llm_model="model-old", llm_prices={"model-old": (1.0, 5.0)}, llm_max_tokens=1000)
OLD_PRICE = Price(Decimal(1), Decimal(5))
REQUEST = StoryRequest(prompt="a sleepy otter")


async def _run(conn: Conn, pool: AsyncConnectionPool, database_url: str, plan: Plan) -> tuple[int, Any]:
    """One job admitted under API with a budget, run by a worker deployed with another model, other prices
    and another LLM_MAX_TOKENS; returns its client and the request the provider received."""
    client = await client_id_of(conn)
    (admitted,) = await ApiStore(conn).job_insert_if_admitted(
        admissions=[admission(client, uuid.uuid4().hex, REQUEST, API)], queue_max=10, client_queue_max=10,
        budget_usd=Decimal(100))
    assert admitted.outcome == "inserted"
    with FakeAnthropicServer(FakeAnthropic(default=plan)) as provider:
        settings = worker_settings(anthropic_api_key="test", anthropic_base_url=provider.base_url,
                                   llm_model="model-new", llm_prices={"model-new": (100.0, 500.0)},
                                   llm_max_tokens=8000)
        writer = AnthropicWriter(settings)
        try:
            async with running_worker(settings, pool, writer, listen_url=database_url):
                await wait_until(lambda: _ended(conn), timeout=20, what="the job to end")
        finally:
            await writer.aclose()
        (call,) = provider.fake.billed
    return client, call


async def _ended(conn: Conn) -> bool:
    return all(job.status in ("completed", "failed") for job in await job_rows(conn))


async def _job_money(conn: Conn) -> tuple[Decimal, Decimal, str]:
    cur = await conn.execute("SELECT j.reserved_usd, j.charged_usd, s.model FROM story_jobs j "
                             "JOIN stories s ON s.id = j.story_id")
    row = await cur.fetchone()
    assert row is not None
    return row[0], row[1], row[2]


async def _days(conn: Conn) -> list[tuple[Any, ...]]:
    cur = await conn.execute("SELECT client_id, spent_usd, reserved_usd, over_reservation_usd FROM budget_days "
                             "ORDER BY client_id")
    return await cur.fetchall()


async def test_a_job_is_run_with_the_model_prices_and_max_tokens_its_reservation_assumed(
    conn: Conn, pool: AsyncConnectionPool, database_url: str
) -> None:
    """The provider is asked for the accepted model and max_tokens, not the worker's, and the job is charged
    at the accepted prices, within what was reserved."""
    client, call = await _run(conn, pool, database_url, Plan(chunks=2))
    assert call.body["model"] == "model-old"
    assert call.body["max_tokens"] == prompt.max_tokens(REQUEST, 1000)
    reserved, charged, model = await _job_money(conn)
    assert model == "model-old"
    assert charged == OLD_PRICE.cost(*await _billed_tokens(conn))
    assert 0 < charged <= reserved
    assert await _days(conn) == [(0, charged, 0, 0), (client, charged, 0, 0)]


async def _billed_tokens(conn: Conn) -> tuple[int, int]:
    """The input and output tokens the ledger recorded for the job's call."""
    cur = await conn.execute("SELECT input_tokens, output_tokens FROM llm_calls WHERE outcome = 'succeeded'")
    row = await cur.fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


async def test_usage_past_admissions_bound_is_charged_and_counted_over_the_reservation(
    conn: Conn, pool: AsyncConnectionPool, database_url: str
) -> None:
    """The provider reports 100 000 input tokens for a short prompt: the job is charged what that cost at
    its accepted prices, the day's spend says so, the excess over the reservation is kept per day, and the
    sweeper exports it in storyjobs_budget_over_reservation_usd_total."""
    client, _ = await _run(conn, pool, database_url, Plan(chunks=2, input_tokens=100_000))
    reserved, charged, _ = await _job_money(conn)
    over = charged - reserved
    input_tokens, output_tokens = await _billed_tokens(conn)
    assert input_tokens == 100_000 and charged == OLD_PRICE.cost(input_tokens, output_tokens) and over > 0
    assert await _days(conn) == [(0, charged, 0, over), (client, charged, 0, over)]
    await Sweeper(sweeper_settings(), PgSweeperStore(pool)).sweep_once()
    assert REGISTRY.get_sample_value("storyjobs_budget_over_reservation_usd_total") == float(over)
