"""OfflineBatches beyond what every provider does (tests/unit/test_batch_providers.py):
its stories, its delay, and what a restart loses."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.support.batches import SettableClock, batch_requests, collect
from worker.batch.offline_batches import OfflineBatches
from worker.batch.provider import BatchNotFound
from worker.batch.provider_structs import BatchState, ResultKind
from worker.offline import OfflineWriter


async def test_a_batch_ends_once_its_delay_has_passed_and_not_before() -> None:
    """An offline batch is in progress until delay_s after its creation, then ended at exactly that time."""
    clock = SettableClock()
    provider = OfflineBatches(delay_s=30, clock=clock)
    created = await provider.create(batch_requests(2))
    clock.advance(29.9)
    assert (await provider.retrieve(created.id)).state is BatchState.IN_PROGRESS
    clock.advance(0.1)
    ended = await provider.retrieve(created.id)
    assert ended.state is BatchState.ENDED
    assert ended.ended_at == ended.created_at + timedelta(seconds=30)


async def test_its_stories_are_the_offline_writers() -> None:
    """Each success carries the offline writer's deterministic title and body for that request."""
    provider = OfflineBatches(delay_s=0)
    requests = batch_requests(3)
    created = await provider.create(requests)
    results = {r.custom_id: r for r in await collect(provider.results(created.id))}
    writer = OfflineWriter(delay_s=0)
    for request in requests:
        result = results[request.custom_id]
        assert result.kind is ResultKind.SUCCEEDED
        assert (result.title, result.body) == writer.compose(request.request)


async def test_a_restarted_process_has_lost_its_batches() -> None:
    """A batch made by one OfflineBatches is unknown to the next (a worker restart): BatchNotFound."""
    first = OfflineBatches(delay_s=0)
    created = await first.create(batch_requests(1))
    again = OfflineBatches(delay_s=0)
    with pytest.raises(BatchNotFound, match="do not outlive"):
        await again.retrieve(created.id)
    assert (await again.create(batch_requests(1))).id != created.id
