"""One suite, every batch provider: AnthropicBatches through the real
anthropic SDK against the fake provider, and OfflineBatches. What the lane
relies on holds for both (River's driver tests are the model)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from tests.fakes.anthropic_batches import FakeBatches
from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer
from tests.support.batches import SettableClock, batch_requests, collect
from worker.batch.anthropic_batches import AnthropicBatches
from worker.batch.offline_batches import OfflineBatches
from worker.batch.provider import BatchNotEnded, BatchNotFound, BatchProvider, BatchRefused, walk
from worker.batch.provider_structs import BATCH_LIFETIME, BatchState, ResultKind

_OFFLINE_DELAY_S = 60.0


@dataclass
class Driver:
    """A provider, its clock, and how a test makes one of its batches end."""

    provider: BatchProvider
    clock: SettableClock
    end: Callable[[str], None]


@pytest.fixture(params=["anthropic", "offline"])
async def driver(request: pytest.FixtureRequest) -> AsyncIterator[Driver]:
    clock = SettableClock()
    if request.param == "offline":
        offline = OfflineBatches(delay_s=_OFFLINE_DELAY_S, clock=clock)
        yield Driver(offline, clock, lambda _batch_id: clock.advance(_OFFLINE_DELAY_S))
        return
    fake = FakeAnthropic(batches=FakeBatches(clock=clock))
    with FakeAnthropicServer(fake) as server:
        provider = AnthropicBatches(api_key="test", base_url=server.base_url, timeout_s=5.0,
                                    create_timeout_s=5.0, clock=clock)

        def end(batch_id: str) -> None:
            fake.batches.end_batch(batch_id)

        try:
            yield Driver(provider, clock, end)
        finally:
            await provider.aclose()


async def test_a_new_batch_is_in_progress_with_every_request_processing(driver: Driver) -> None:
    """A created batch is in progress, counts all its requests as processing and expires a day after creation."""
    created = await driver.provider.create(batch_requests(3))
    assert created.state is BatchState.IN_PROGRESS
    assert (created.counts.processing, created.counts.total) == (3, 3)
    assert created.expires_at - created.created_at == BATCH_LIFETIME
    assert created.ended_at is None
    retrieved = await driver.provider.retrieve(created.id)
    assert (retrieved.id, retrieved.state, retrieved.counts) == (created.id, BatchState.IN_PROGRESS, created.counts)


async def test_an_ended_batch_gives_one_story_with_usage_per_request(driver: Driver) -> None:
    """Once ended, the batch counts each request succeeded and its results carry a story and usage per custom_id."""
    requests = batch_requests(4)
    created = await driver.provider.create(requests)
    driver.end(created.id)
    ended = await driver.provider.retrieve(created.id)
    assert ended.state is BatchState.ENDED and ended.ended is True
    assert ended.counts.succeeded == 4 and ended.counts.processing == 0
    assert ended.ended_at is not None
    results = await collect(driver.provider.results(created.id))
    assert sorted(r.custom_id for r in results) == sorted(r.custom_id for r in requests)
    for result in results:
        assert result.kind is ResultKind.SUCCEEDED and result.may_be_billed
        assert result.title and result.body
        assert result.input_tokens is not None and result.input_tokens > 0
        assert result.output_tokens is not None and result.output_tokens > 0


async def test_results_read_twice_are_the_same(driver: Driver) -> None:
    """Reading an ended batch's results again gives the same results (ingestion may repeat a read)."""
    created = await driver.provider.create(batch_requests(5))
    driver.end(created.id)
    first = await collect(driver.provider.results(created.id))
    second = await collect(driver.provider.results(created.id))
    assert first == second and len(first) == 5


async def test_results_of_a_batch_that_has_not_ended_are_refused(driver: Driver) -> None:
    """Asking for the results of a batch still in progress raises BatchNotEnded."""
    created = await driver.provider.create(batch_requests(1))
    with pytest.raises(BatchNotEnded):
        await collect(driver.provider.results(created.id))


async def test_the_list_is_newest_first_and_pages_both_ways(driver: Driver) -> None:
    """list_page gives batches newest first; after_id pages towards older ones, before_id towards newer, has_more as the API says."""
    ids = [(await driver.provider.create(batch_requests(1, prefix=f"b{n}"))).id for n in range(5)]
    newest_first = ids[::-1]
    first = await driver.provider.list_page(limit=2)
    assert [b.id for b in first.batches] == newest_first[:2] and first.has_more
    assert (first.first_id, first.last_id) == (newest_first[0], newest_first[1])
    second = await driver.provider.list_page(after_id=first.last_id, limit=2)
    assert [b.id for b in second.batches] == newest_first[2:4] and second.has_more
    last = await driver.provider.list_page(after_id=second.last_id, limit=2)
    assert [b.id for b in last.batches] == newest_first[4:] and not last.has_more
    newer = await driver.provider.list_page(before_id=newest_first[3], limit=2)
    assert [b.id for b in newer.batches] == newest_first[1:3] and newer.has_more
    newest = await driver.provider.list_page(before_id=newest_first[1], limit=2)
    assert [b.id for b in newest.batches] == newest_first[:1] and not newest.has_more
    everything = await driver.provider.list_page(limit=1000)
    assert [b.id for b in everything.batches] == newest_first and not everything.has_more


async def test_a_list_limit_outside_1_to_1000_is_refused_before_sending(driver: Driver) -> None:
    """list_page refuses a limit of 0 or 1001 with ValueError."""
    for limit in (0, 1001):
        with pytest.raises(ValueError, match="limit"):
            await driver.provider.list_page(limit=limit)


async def test_walk_reads_every_page_newest_first_until_its_predicate_stops_it(driver: Driver) -> None:
    """walk follows the pages newest first and ends before the first batch its stop predicate accepts."""
    ids = [(await driver.provider.create(batch_requests(1, prefix=f"w{n}"))).id for n in range(5)]
    everything = [b.id async for b in walk(driver.provider, stop=lambda _b: False, page_size=2)]
    assert everything == ids[::-1]
    fence = ids[1]
    stopped = [b.id async for b in walk(driver.provider, stop=lambda b: b.id == fence, page_size=2)]
    assert stopped == ids[:1:-1]


async def test_a_cancelled_batch_ends_with_its_requests_canceled(driver: Driver) -> None:
    """A cancel answers canceling; the batch then ends with every request canceled and nothing to bill."""
    created = await driver.provider.create(batch_requests(2))
    cancelling = await driver.provider.cancel(created.id)
    assert cancelling.state is BatchState.CANCELING and cancelling.cancel_initiated_at is not None
    ended = await driver.provider.retrieve(created.id)
    assert ended.state is BatchState.ENDED and ended.counts.canceled == 2
    results = await collect(driver.provider.results(created.id))
    assert [r.kind for r in results] == [ResultKind.CANCELED] * 2
    assert not any(r.may_be_billed for r in results)


async def test_an_ended_batch_cannot_be_cancelled(driver: Driver) -> None:
    """Cancelling a batch that has ended is refused (BatchRefused)."""
    created = await driver.provider.create(batch_requests(1))
    driver.end(created.id)
    with pytest.raises(BatchRefused):
        await driver.provider.cancel(created.id)


async def test_only_an_ended_batch_can_be_deleted_and_then_it_is_gone(driver: Driver) -> None:
    """Deleting a batch in progress is refused; once ended it is deleted, and then unknown and unlisted."""
    created = await driver.provider.create(batch_requests(1))
    with pytest.raises(BatchRefused):
        await driver.provider.delete(created.id)
    driver.end(created.id)
    await driver.provider.delete(created.id)
    with pytest.raises(BatchNotFound):
        await driver.provider.retrieve(created.id)
    assert created.id not in [b.id for b in (await driver.provider.list_page()).batches]


async def test_a_batch_the_provider_does_not_know_is_not_found(driver: Driver) -> None:
    """Retrieve, cancel and results of an unknown batch id raise BatchNotFound."""
    with pytest.raises(BatchNotFound):
        await driver.provider.retrieve("msgbatch_unknown")
    with pytest.raises(BatchNotFound):
        await driver.provider.cancel("msgbatch_unknown")
    with pytest.raises(BatchNotFound):
        await collect(driver.provider.results("msgbatch_unknown"))


async def test_a_batch_the_provider_would_refuse_is_never_sent(driver: Driver) -> None:
    """A batch with no request or with a custom_id twice raises ValueError before anything is sent."""
    with pytest.raises(ValueError, match="at least one"):
        await driver.provider.create([])
    with pytest.raises(ValueError, match="twice"):
        await driver.provider.create(batch_requests(2) + batch_requests(1))
    assert (await driver.provider.list_page()).batches == ()
