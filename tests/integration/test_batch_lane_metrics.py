"""The batch lane's metrics on Postgres against the fake provider: what the
lease holder reports of the batches in flight, and that a worker that no
longer holds the lease stops reporting them (a stale figure would keep an
alert firing); requests by result, cost and saving; and the sweeper's
queue gauges, which leave the batch lane out. Each worker is a process of
its own in production; here the registry is the test process's, so each
test reads it right after the tick it checks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from sweeper.rows import QueueGauges
from sweeper.store import PgSweeperStore
from tests.fakes.anthropic_batches import FakeBatches
from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer
from tests.support.database import client_id_of, enqueue, enqueue_batch
from tests.support.settings import worker_settings
from worker.batch.anthropic_batches import AnthropicBatches
from worker.batch.lane import BatchLane
from worker.batch.store import BatchStore

Conn = psycopg.AsyncConnection[Any]


@pytest.fixture
def server() -> Iterator[FakeAnthropicServer]:
    with FakeAnthropicServer(FakeAnthropic(batches=FakeBatches())) as started:
        yield started


@pytest.fixture
async def lane(pool: AsyncConnectionPool, server: FakeAnthropicServer) -> AsyncIterator[BatchLane]:
    provider = AnthropicBatches(api_key="test", base_url=server.base_url, timeout_s=5.0, create_timeout_s=3.0)
    settings = worker_settings(anthropic_api_key="test", batch_collect_s=1.0, batch_poll_interval_s=1.0)
    ticks = iter(range(0, 10**9, 3600))
    yield BatchLane(settings, BatchStore(pool), provider, holder="w-1", clock=lambda: float(next(ticks)))
    await provider.aclose()


def _sample(name: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    assert value is not None, (name, labels)
    return value


async def test_the_holder_reports_its_batches_in_flight_and_a_worker_that_lost_the_lease_reports_none(
    conn: Conn, lane: BatchLane, server: FakeAnthropicServer,
) -> None:
    """The holder's next tick counts the batch it sent as in flight; once another worker holds the lease, this
    worker's tick reports no batch in flight in any state, where its last figures would otherwise stay."""
    client = await client_id_of(conn)
    for n in range(2):
        await enqueue_batch(conn, client, f"a lantern numbered {n}")
    assert (await lane.tick_once()).submitted == 2
    assert (await lane.tick_once()).holding
    assert _sample("storyjobs_batches_in_flight", state="sent") == 1
    # another worker holds the lease now (this one's ran out while it was busy)
    await conn.execute("UPDATE batch_leases SET holder = 'w-2', until = now() + interval '1 hour', "
                       "token = token + 1 WHERE name = 'submitter'")
    assert not (await lane.tick_once()).holding
    assert [_sample("storyjobs_batches_in_flight", state=state) for state in ("intent", "sent", "stray", "lost")] \
        == [0, 0, 0, 0]


async def test_results_read_count_requests_by_result_and_what_the_lane_saved(
    conn: Conn, lane: BatchLane, server: FakeAnthropicServer,
) -> None:
    """Reading an ended batch's results counts its requests by result, adds what they cost at the batch price
    and what the same requests would have cost more at the interactive price (as much again, at half)."""
    client = await client_id_of(conn)
    for n in range(3):
        await enqueue_batch(conn, client, f"a kite numbered {n}")
    before = {name: _sample(name) for name in ("storyjobs_batch_cost_usd_total", "storyjobs_batch_saved_usd_total")}
    succeeded = _sample("storyjobs_batch_requests_total", result="succeeded")
    read = _sample("storyjobs_batches_total", event="read")
    assert (await lane.tick_once()).submitted == 3
    server.fake.batches.end_batch(server.fake.batches.batches[0].id)
    assert (await lane.tick_once()).completed == 3
    assert _sample("storyjobs_batch_requests_total", result="succeeded") - succeeded == 3
    assert _sample("storyjobs_batches_total", event="read") - read == 1
    cur = await conn.execute("SELECT sum(cost_usd) FROM llm_calls WHERE billed")
    (ledger,) = await cur.fetchone() or (None,)
    assert isinstance(ledger, Decimal) and ledger > 0
    cost = _sample("storyjobs_batch_cost_usd_total") - before["storyjobs_batch_cost_usd_total"]
    saved = _sample("storyjobs_batch_saved_usd_total") - before["storyjobs_batch_saved_usd_total"]
    assert cost == pytest.approx(float(ledger)) and saved == pytest.approx(float(ledger))


async def test_the_sweepers_queue_gauges_count_the_interactive_lane_only(conn: Conn) -> None:
    """Batch jobs waiting for a batch (for hours, here) are neither pending jobs nor the oldest pending age of
    the sweeper's gauges, which watch the queue the workers claim from (StoryjobsNoWorkerClaiming,
    StoryjobsOldestPendingJobTooOld)."""
    client = await client_id_of(conn)
    await enqueue_batch(conn, client, "a kite numbered 1", waited_s=7200)
    await enqueue_batch(conn, client, "a kite numbered 2", waited_s=7200)
    assert await PgSweeperStore(conn).queue_gauges() == QueueGauges(pending=0, running=0, oldest_pending_age_seconds=0.0)
    await enqueue(conn, client, "a dragon who cannot sleep")
    await conn.execute("UPDATE story_jobs SET created_at = now() - interval '30 seconds' WHERE lane = 'interactive'")
    gauges = await PgSweeperStore(conn).queue_gauges()
    assert (gauges.pending, gauges.running) == (1, 0) and 29 <= gauges.oldest_pending_age_seconds < 3600
