"""The batch lane's lease outlasts a create (worker.batch.lane BatchLane.lease_s):
the holder renews it just before it creates, so with the lease at least two
create timeouts long, no other worker can take the lease, and send a batch
of the same jobs, while a create is in flight."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.settings import worker_settings
from worker.batch.anthropic_batches import AnthropicBatches
from worker.batch.lane import BatchLane


@pytest.mark.parametrize("create_timeout_s", [1.0, 30.0, 120.0, 600.0])
async def test_the_lease_is_at_least_two_create_timeouts_long(create_timeout_s: float) -> None:
    store: Any = None  # never reached: only the lease's length is read
    provider = AnthropicBatches(api_key="test", base_url="http://127.0.0.1:9", timeout_s=5.0,
                                create_timeout_s=create_timeout_s)
    try:
        lane = BatchLane(worker_settings(), store, provider)
        assert lane.lease_s >= 2 * create_timeout_s
    finally:
        await provider.aclose()
