"""How often the batch lane looks (worker/batch/lane.py): often enough that a
batch is sent within a tenth of BATCH_COLLECT_S after its window closes and a
batch in flight is polled on time, never more than once a second."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.settings import worker_settings
from worker.batch.lane import BatchLane
from worker.batch.offline_batches import OfflineBatches


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
