"""The batch lane's lease passing from a holder that stops to a worker on
standby (worker/batch/lane.py): the stopping holder gives the lease up, and
the standby, which asks again a third of the lease after each look, takes it
at its next look, not when the lease would have run out."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from tests.support.settings import worker_settings
from tests.support.waiting import wait_until
from worker.batch.lane import BatchLane
from worker.batch.offline_batches import OfflineBatches
from worker.batch.store import BatchStore


async def test_a_stopped_holders_lease_is_taken_at_the_standbys_next_look(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    """The standby looks 10.7 s apart (a third of the offline lane's 32 s lease, under the 30 s cap): once the
    holder stops, the standby holds the lease within that, well before the 32 s the lease had left."""
    settings = worker_settings(batch_collect_s=1.0, batch_poll_interval_s=1.0)
    holder = BatchLane(settings, BatchStore(pool), OfflineBatches(delay_s=0), holder="w-1")
    standby = BatchLane(settings, BatchStore(pool), OfflineBatches(delay_s=0), holder="w-2")
    assert standby.lease_s / 3 < 30.0
    holding = asyncio.create_task(holder.run())
    await wait_until(lambda: holder.lease is not None, what="the first worker to hold the lease")
    waiting = asyncio.create_task(standby.run())
    try:
        # the standby's first look finds the lease held
        await asyncio.sleep(0.5)
        assert standby.lease is None
        holder.stop()
        await holding
        stopped_at = time.monotonic()
        await wait_until(lambda: standby.lease is not None, timeout=standby.lease_s / 3 + 5.0,
                         what="the standby to take the lease at its next look")
        assert time.monotonic() - stopped_at < holder.lease_s - 5.0
    finally:
        standby.stop()
        await waiting
    cur = await conn.execute("SELECT holder, until > now() FROM batch_leases")
    assert await cur.fetchall() == [("w-2", False)]
