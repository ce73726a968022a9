"""A batch's size as the provider describes it (worker/batch/anthropic_reading.py
into BatchCounts.total): what a lost intent is matched by (its request count,
worker/batch/reconciler.py) and what a stray is recorded with, whatever state
its requests have reached."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from worker.batch.anthropic_reading import batch_info
from worker.batch.provider_structs import BatchCounts


@pytest.mark.parametrize(("status", "counts"), [
    ("in_progress", {"processing": 8}),
    ("canceling", {"processing": 3, "succeeded": 2, "canceled": 3}),
    ("ended", {"succeeded": 4, "errored": 2, "canceled": 1, "expired": 1}),
])
def test_a_batch_of_eight_requests_is_eight_in_every_state_they_reach(status: str, counts: dict[str, int]) -> None:
    """Eight requests are eight whether they wait, succeeded, errored, were cancelled or expired: an intent of
    eight whose create answer was lost adopts its batch even after some of its requests errored."""
    info = batch_info({"id": "msgbatch_1", "processing_status": status, "request_counts": counts},
                      datetime.now(UTC))
    assert info is not None
    assert info.counts == BatchCounts(**counts)
    assert info.counts.total == 8
