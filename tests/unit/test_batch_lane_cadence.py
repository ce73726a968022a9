"""How often the batch lane looks (worker/batch/lane.py): often enough that a
batch is sent within a tenth of BATCH_COLLECT_S after its window closes and a
batch in flight is polled on time, never more than once a second."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

import pytest
from opentelemetry import trace

from tests.support.settings import worker_settings
from worker.batch.collector import Collector
from worker.batch.lane import BatchLane
from worker.batch.offline_batches import OfflineBatches
from worker.batch.provider import BatchUnavailable
from worker.batch.rows import LiveBatch
from worker.batch.tick import TickResult


@pytest.mark.parametrize(("collect_s", "poll_s", "tick_s"), [
    (60.0, 60.0, 6.0),     # the defaults: a tenth of the window
    (600.0, 60.0, 30.0),   # a long window: half the poll interval
    (5.0, 60.0, 1.0),      # never more often than once a second
])
def test_the_lane_looks_within_a_tenth_of_the_window_and_half_the_poll_interval(
    collect_s: float, poll_s: float, tick_s: float,
) -> None:
    """The lane's wait between looks is a tenth of BATCH_COLLECT_S, at most half of BATCH_POLL_INTERVAL_S, at least 1 s."""
    store: Any = None  # never reached: only the cadence is read
    lane = BatchLane(worker_settings(batch_collect_s=collect_s, batch_poll_interval_s=poll_s), store,
                     OfflineBatches(delay_s=0))
    assert lane._tick_s == tick_s


class _ProviderDown:
    """A provider that answers nothing: a look at a batch changes nothing but when it was looked at."""

    provider = "anthropic"

    async def retrieve(self, provider_batch_id: str) -> Any:
        raise BatchUnavailable(f"{provider_batch_id}: no answer")


async def test_a_batch_in_flight_is_looked_at_once_per_poll_interval() -> None:
    """A batch in flight is asked about again only once BATCH_POLL_INTERVAL_S has passed since the last look,
    however often the lane ticks: the provider's rate limits are spent on news, not on asking."""
    now = [1000.0]
    store: Any = None  # never reached: the provider does not answer
    collector = Collector(worker_settings(batch_poll_interval_s=60.0), store, cast(Any, _ProviderDown()),
                          trace.get_tracer("test"), lambda: now[0])
    batch = LiveBatch(id=1, state="sent", provider_batch_id="msgbatch_1", model="m", request_count=1,
                      fence_at=datetime.now(UTC), expires_at=None, processing_status=None, cancel_asked_at=None,
                      lost_batch_id=None, age_s=0.0, abandoned=False)
    assert collector.poll_due(batch)
    await collector.collect(cast(Any, None), batch, TickResult())
    due = []
    for elapsed in (1.0, 30.0, 59.9, 60.0):
        now[0] = 1000.0 + elapsed
        due.append(collector.poll_due(batch))
    assert due == [False, False, False, True]
