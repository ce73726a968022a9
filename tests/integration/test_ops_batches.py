"""The batch lane in the operators' console's JSON endpoints (/ops/api), on a
real Postgres with batches made by the real lane against the fake provider:
the batches list (state, the provider's id and counts, age, expiry, cost
from the ledger and what it saved), its pages, each job's lane in the jobs
list, a batch job's batch and due time on its page, and the batch lane kept
apart from the interactive queue on the overview and the workers screen."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from shared.pricing import BATCH_PRICE_FACTOR
from tests.fakes.anthropic_batches import FakeBatches
from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer
from tests.support import ops_seed as seed
from tests.support.api_client import api_client, assert_problem
from tests.support.database import enqueue_batch
from tests.support.settings import worker_settings
from worker.batch.anthropic_batches import AnthropicBatches
from worker.batch.lane import BatchLane
from worker.batch.store import BatchStore

OPS = "/ops/api"
Conn = psycopg.AsyncConnection[Any]


@pytest.fixture
def server() -> Iterator[FakeAnthropicServer]:
    with FakeAnthropicServer(FakeAnthropic(batches=FakeBatches())) as started:
        yield started


@pytest.fixture
async def lane(pool: AsyncConnectionPool, server: FakeAnthropicServer) -> AsyncIterator[BatchLane]:
    """The batch lane on the test's pool, against the fake provider through the real SDK."""
    provider = AnthropicBatches(api_key="test", base_url=server.base_url, timeout_s=5.0, create_timeout_s=3.0)
    settings = worker_settings(anthropic_api_key="test", batch_collect_s=1.0, batch_poll_interval_s=1.0)
    yield BatchLane(settings, BatchStore(pool), provider, holder="w-lane", clock=_far_apart())
    await provider.aclose()


def _far_apart() -> Any:
    """The lane's own clock: an hour between reads, so every tick polls every batch."""
    ticks = iter(range(0, 10**9, 3600))
    return lambda: float(next(ticks))


async def _scalar(conn: Conn, query: str, *params: Any) -> Any:
    cur = await conn.execute(query, params)
    row = await cur.fetchone()
    assert row is not None
    return row[0]


async def _two_batches(conn: Conn, lane: BatchLane, fake: FakeBatches) -> tuple[int, list[str], list[str]]:
    """Three jobs through one batch, ended and read; then two jobs in a second, in flight. The client's id and
    both batches' jobs (their public ids)."""
    client, _ = await seed.client(conn, "acme")
    first = [str(await enqueue_batch(conn, client, f"a lantern numbered {n}")) for n in range(3)]
    assert (await lane.tick_once()).submitted == 3
    fake.end_batch(fake.batches[0].id)
    assert (await lane.tick_once()).completed == 3
    second = [str(await enqueue_batch(conn, client, f"a kite numbered {n}")) for n in range(2)]
    assert (await lane.tick_once()).submitted == 2
    return client, first, second


async def test_the_batches_list_shows_each_batch_with_its_counts_age_expiry_cost_and_saving(
    pool: AsyncConnectionPool, conn: Conn, lane: BatchLane, server: FakeAnthropicServer,
) -> None:
    """Two batches, newest first: the one in flight with the provider's id, its requests processing, its expiry
    and nothing billed yet; the one read with its three successes, what its ledger rows cost at the batch price
    and what that saved against the interactive price (cost × (1/BATCH_PRICE_FACTOR − 1))."""
    fake = server.fake.batches
    await _two_batches(conn, lane, fake)
    key = await seed.operator_key(conn)
    async with api_client(pool, key) as client:
        answer = await client.get(f"{OPS}/batches")
    assert answer.status_code == 200, answer.text
    assert answer.headers["cache-control"] == "no-store"
    page = answer.json()
    assert page["next_cursor"] is None and Decimal(page["price_factor"]) == BATCH_PRICE_FACTOR
    in_flight, ended = page["batches"]
    assert in_flight["id"] > ended["id"]
    made = {batch.id: batch for batch in fake.batches}
    for shown in (in_flight, ended):
        made_there = made[shown["provider_batch_id"]]
        assert datetime.fromisoformat(shown["expires_at"]) == made_there.expires_at
        assert shown["model"] and shown["holder"] == "w-lane" and shown["age_s"] >= 0
    assert (in_flight["state"], in_flight["request_count"], in_flight["processing_status"]) == ("sent", 2, "in_progress")
    # not looked at since its create answered
    assert in_flight["counts"] is None
    assert (in_flight["billed_requests"], in_flight["cost_usd"], in_flight["saved_usd"]) == (0, "0.000000", "0.000000")
    assert (ended["state"], ended["request_count"], ended["processing_status"]) == ("ended", 3, "ended")
    assert ended["counts"] == {"processing": 0, "succeeded": 3, "errored": 0, "canceled": 0, "expired": 0}
    assert ended["results_read_at"] is not None and ended["billed_requests"] == 3
    ledger = await _scalar(conn, "SELECT sum(cost_usd) FROM llm_calls WHERE batch_id = %s AND billed", ended["id"])
    assert ledger > 0 and Decimal(ended["cost_usd"]) == ledger
    assert Decimal(ended["saved_usd"]) == (ledger * (1 / BATCH_PRICE_FACTOR - 1)).quantize(Decimal("0.000001"))
    # what the same tokens cost at the model's interactive price, less what was paid
    interactive = await _scalar(
        conn, "SELECT sum(round((c.input_tokens * j.input_usd_per_mtok + c.output_tokens * j.output_usd_per_mtok) "
              "/ %s / 1000000, 6)) FROM llm_calls c JOIN story_jobs j ON j.id = c.job_id WHERE c.batch_id = %s",
        BATCH_PRICE_FACTOR, ended["id"])
    assert abs(Decimal(ended["saved_usd"]) - (interactive - ledger)) <= Decimal("0.000003")


async def test_the_batches_list_pages_newest_first_through_every_batch(pool: AsyncConnectionPool, conn: Conn) -> None:
    """Seven batches read two at a time by cursor come newest first, each once; a cursor the api did not make
    is a 400."""
    for n in range(7):
        await conn.execute(
            "INSERT INTO message_batches (state, provider_batch_id, model, request_count, expires_at) "
            "VALUES ('sent', %s, 'claude-sonnet-5-5', %s, now() + interval '1 day')", (f"msgbatch_{n}", n + 1))
    key = await seed.operator_key(conn)
    found: list[int] = []
    cursor = None
    async with api_client(pool, key) as client:
        for _ in range(10):
            page = (await client.get(f"{OPS}/batches", params={"limit": 2, **({"cursor": cursor} if cursor else {})}))
            assert page.status_code == 200, page.text
            found += [batch["id"] for batch in page.json()["batches"]]
            cursor = page.json()["next_cursor"]
            if cursor is None:
                break
        assert_problem(await client.get(f"{OPS}/batches", params={"cursor": "bm90LW91cnM"}), 400)
        assert_problem(await client.get(f"{OPS}/batches", params={"state": "sent"}), 400)
    cur = await conn.execute("SELECT id FROM message_batches ORDER BY id DESC")
    assert found == [row[0] for row in await cur.fetchall()] and len(found) == 7


async def test_the_jobs_list_shows_each_jobs_lane_and_a_batch_jobs_page_its_batch_and_due_time(
    pool: AsyncConnectionPool, conn: Conn, lane: BatchLane, server: FakeAnthropicServer,
) -> None:
    """Batch jobs are listed with lane batch beside an interactive one; a job in a batch in flight shows that
    batch (its provider id and state) and is due by the batch's expiry; a job still waiting for a batch shows
    since when, and is due a collection and a day after it."""
    client, first, second = await _two_batches(conn, lane, server.fake.batches)
    [interactive] = await seed.insert_jobs(conn, [seed.pending(client, 5)])
    waiting = str(await enqueue_batch(conn, client, "a boat that hums", waited_s=0))
    key = await seed.operator_key(conn)
    async with api_client(pool, key, batch_collect_s=90.0) as api:
        listed = (await api.get(f"{OPS}/jobs")).json()["jobs"]
        in_batch = (await api.get(f"{OPS}/jobs/{second[0]}")).json()
        ready = (await api.get(f"{OPS}/jobs/{waiting}")).json()
        done = (await api.get(f"{OPS}/jobs/{first[0]}")).json()
        plain = (await api.get(f"{OPS}/jobs/{interactive.public_id}")).json()
    lanes = {job["job_id"]: job["lane"] for job in listed}
    assert lanes == {**dict.fromkeys([*first, *second, waiting], "batch"), str(interactive.public_id): "interactive"}
    cur = await conn.execute("SELECT id, provider_batch_id, expires_at FROM message_batches WHERE state = 'sent'")
    ((batch_id, provider_id, expires_at),) = await cur.fetchall()
    assert (in_batch["lane"], in_batch["status"]) == ("batch", "running")
    assert in_batch["batch"] == {"id": batch_id, "state": "sent", "provider_batch_id": provider_id,
                                 "processing_status": "in_progress",
                                 "expires_at": in_batch["batch"]["expires_at"]}
    assert in_batch["due_by"] == in_batch["batch"]["expires_at"] and in_batch["waiting_for_batch_since"] is None
    assert datetime.fromisoformat(in_batch["batch"]["expires_at"]) == expires_at
    ready_at = await _scalar(conn, "SELECT batch_ready_at FROM story_jobs WHERE public_id = %s", waiting)
    assert (ready["status"], ready["batch"]) == ("pending", None)
    assert datetime.fromisoformat(ready["waiting_for_batch_since"]) == ready_at
    assert datetime.fromisoformat(ready["due_by"]) == ready_at + timedelta(seconds=90, hours=24)
    assert (done["status"], done["batch"]["state"], done["due_by"]) == ("completed", "ended", None)
    assert (plain["lane"], plain["batch"], plain["due_by"]) == ("interactive", None, None)


async def test_the_overview_and_the_workers_keep_the_batch_lane_apart_from_the_interactive_queue(
    pool: AsyncConnectionPool, conn: Conn, lane: BatchLane, server: FakeAnthropicServer,
) -> None:
    """Batch jobs in a batch and waiting for one count as the batch lane's live jobs, not as the interactive
    queue's pending or running jobs, nor its oldest pending age; a batch is no worker on the workers screen."""
    client, _, second = await _two_batches(conn, lane, server.fake.batches)
    await enqueue_batch(conn, client, "a boat that hums", waited_s=7200)
    await seed.insert_jobs(conn, [seed.pending(client, 30), seed.running(client, 20, worker_id="w-busy")])
    key = await seed.operator_key(conn)
    async with api_client(pool, key, batch_queue_max=500) as api:
        queue = (await api.get(f"{OPS}/overview")).json()["queue"]
        workers = (await api.get(f"{OPS}/workers")).json()["workers"]
    assert (queue["pending"], queue["running"], queue["batch_live"], queue["batch_queue_max"]) == (1, 1, 3, 500)
    assert 25 <= queue["oldest_pending_age_s"] < 3600
    assert {worker["worker_id"] for worker in workers} == {"w-busy", "w-lane"}
    assert all(not worker["worker_id"].startswith("batch-") for worker in workers)
    assert len(second) == 2
