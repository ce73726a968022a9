"""The fake provider's Message Batches endpoints, through the anthropic SDK
as it is: they refuse what the API documents it refuses, and keep the
record tests rely on (what was billed, per custom_id, across batches)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from tests.fakes.anthropic_batches import MAX_REQUESTS, BatchPlan, FakeBatches, Invalid, ItemPlan
from tests.fakes.anthropic_server import FakeAnthropicServer
from tests.support.batches import SettableClock


def _request(custom_id: Any, prompt: str = "a sleepy otter", **params: Any) -> Any:
    """One request as sent, deliberately untyped: tests send what the SDK's types would not allow."""
    return {"custom_id": custom_id, "params": {
        "model": "claude-test", "max_tokens": 100, "messages": [{"role": "user", "content": prompt}], **params}}


@pytest.fixture
async def sdk(server: FakeAnthropicServer) -> AsyncIterator[anthropic.AsyncAnthropic]:
    client = anthropic.AsyncAnthropic(api_key="test", base_url=server.base_url, max_retries=0, timeout=5.0)
    yield client
    await client.close()


@pytest.mark.parametrize("custom_id", ["", "has space", "x" * 65, "dot.ted", "new\nline", "trailing\n", 7])
async def test_a_custom_id_outside_the_pattern_is_refused(
    sdk: anthropic.AsyncAnthropic, fake: FakeBatches, custom_id: Any,
) -> None:
    """A create with a custom_id not matching ^[a-zA-Z0-9_-]{1,64}$ is answered 400 and makes no batch."""
    with pytest.raises(anthropic.BadRequestError, match="custom_id"):
        await sdk.messages.batches.create(requests=[_request(custom_id)])
    assert fake.batches == []


async def test_a_custom_id_of_64_allowed_characters_is_accepted(sdk: anthropic.AsyncAnthropic) -> None:
    """A custom_id of exactly 64 letters, digits, dashes and underscores is accepted."""
    custom_id = ("aZ09_-" * 11)[:64]
    batch = await sdk.messages.batches.create(requests=[_request(custom_id)])
    assert batch.request_counts.processing == 1


async def test_a_custom_id_twice_in_one_batch_is_refused(sdk: anthropic.AsyncAnthropic, fake: FakeBatches) -> None:
    """Two requests with one custom_id in a batch are answered 400."""
    with pytest.raises(anthropic.BadRequestError, match="twice"):
        await sdk.messages.batches.create(requests=[_request("a"), _request("a")])
    assert fake.batches == []


async def test_stream_is_refused_inside_a_batch(sdk: anthropic.AsyncAnthropic, fake: FakeBatches) -> None:
    """A request whose params hold ``stream`` is refused with 400."""
    with pytest.raises(anthropic.BadRequestError, match="stream"):
        await sdk.messages.batches.create(requests=[_request("a", stream=True)])
    assert fake.batches == [] and fake.creates[0].status == 400


def test_a_batch_holds_at_most_100000_requests(fake: FakeBatches) -> None:
    """The fake refuses a 100,001st request, as the API does, and accepts 100,000."""
    requests = [_request(f"r{i}") for i in range(MAX_REQUESTS + 1)]
    with pytest.raises(Invalid, match="at most 100000"):
        fake.make_batch(requests)
    assert len(fake.batch(fake.make_batch(requests[:MAX_REQUESTS])).items) == MAX_REQUESTS


@pytest.mark.parametrize("query", [{"limit": 0}, {"limit": 1001}, {"after_id": "x", "before_id": "y"}])
async def test_a_list_query_outside_the_api_is_refused(
    sdk: anthropic.AsyncAnthropic, fake: FakeBatches, query: dict[str, Any],
) -> None:
    """A list with limit outside 1..1000, or with both cursors, is answered 400."""
    for n in range(2):
        fake.make_batch([_request(f"r{n}")])
    if "after_id" in query:
        query = {"after_id": fake.batches[0].id, "before_id": fake.batches[1].id}
    with pytest.raises(anthropic.BadRequestError):
        await sdk.messages.batches.list(**query)


async def test_counts_stay_processing_until_the_batch_ends_and_results_url_appears_then(
    sdk: anthropic.AsyncAnthropic, fake: FakeBatches, server: FakeAnthropicServer,
) -> None:
    """Before the end every request counts as processing and there is no results_url; after, the counts add up and results_url points at the fake."""
    fake.queue(BatchPlan(items={"b": ItemPlan(result="errored")}))
    batch = await sdk.messages.batches.create(requests=[_request("a"), _request("b")])
    assert (batch.request_counts.processing, batch.request_counts.succeeded, batch.results_url) == (2, 0, None)
    fake.end_batch(batch.id)
    ended = await sdk.messages.batches.retrieve(batch.id)
    counts = ended.request_counts
    assert (counts.processing, counts.succeeded, counts.errored) == (0, 1, 1)
    assert ended.results_url == f"{server.base_url}/v1/messages/batches/{batch.id}/results"


async def test_a_batch_ends_by_itself_after_its_auto_end_delay(
    sdk: anthropic.AsyncAnthropic, fake: FakeBatches, clock: SettableClock,
) -> None:
    """A plan's auto_end_s ends the batch at the first look once that long has passed, not before."""
    fake.queue(BatchPlan(auto_end_s=3600))
    batch = await sdk.messages.batches.create(requests=[_request("a")])
    clock.advance(3599)
    assert (await sdk.messages.batches.retrieve(batch.id)).processing_status == "in_progress"
    clock.advance(1)
    assert (await sdk.messages.batches.retrieve(batch.id)).processing_status == "ended"


async def test_results_come_in_an_order_of_their_own_the_same_at_every_read(
    sdk: anthropic.AsyncAnthropic, fake: FakeBatches,
) -> None:
    """The JSONL lines are not in the requests' order, and two reads give the same order."""
    ids = [f"r{i:02d}" for i in range(20)]
    batch = await sdk.messages.batches.create(requests=[_request(i) for i in ids])
    fake.end_batch(batch.id)
    first = [line.custom_id async for line in await sdk.messages.batches.results(batch.id)]
    second = [line.custom_id async for line in await sdk.messages.batches.results(batch.id)]
    assert sorted(first) == ids and first != ids and first == second


async def test_the_fake_records_each_billed_request_across_batches(
    sdk: anthropic.AsyncAnthropic, fake: FakeBatches,
) -> None:
    """Only successes are billed, each with its usage, and a custom_id billed in two batches counts twice."""
    fake.queue(BatchPlan(items={"job-2": ItemPlan(result="expired")}),
               BatchPlan(items={"job-1": ItemPlan(result="errored", error_type="overloaded_error")}))
    first = await sdk.messages.batches.create(requests=[_request("job-1", "story one"), _request("job-2")])
    second = await sdk.messages.batches.create(requests=[_request("job-1", "story one"), _request("job-2")])
    fake.end_batch(first.id)
    fake.end_batch(second.id)
    assert [(b.batch_id, b.custom_id) for b in fake.billed] == [(first.id, "job-1"), (second.id, "job-2")]
    assert fake.billed[0].input_tokens == 2 and fake.billed[0].output_tokens > 0
    assert fake.bills_by_custom_id() == {"job-1": 1, "job-2": 1}
    assert [b.batch_id for b in fake.billed_for("story one")] == [first.id]


async def test_items_planned_by_prompt_end_as_planned_in_a_later_batch(
    sdk: anthropic.AsyncAnthropic, fake: FakeBatches,
) -> None:
    """queue_items_for plans the next requests whose prompt holds a fragment, whatever their custom_id."""
    fake.queue_items_for("grumpy", ItemPlan(result="errored", error_type="invalid_request_error"))
    batch = await sdk.messages.batches.create(requests=[_request("a", "a grumpy cloud"), _request("b")])
    fake.end_batch(batch.id)
    kinds = {line.custom_id: line.result.type async for line in await sdk.messages.batches.results(batch.id)}
    assert kinds == {"a": "errored", "b": "succeeded"}


async def test_a_deleted_batch_is_gone_and_a_batch_in_progress_cannot_be_deleted(
    sdk: anthropic.AsyncAnthropic, fake: FakeBatches,
) -> None:
    """DELETE of a batch in progress is answered 400; once ended it is deleted and then 404 to every call."""
    batch = await sdk.messages.batches.create(requests=[_request("a")])
    with pytest.raises(anthropic.BadRequestError, match="cancel it"):
        await sdk.messages.batches.delete(batch.id)
    fake.end_batch(batch.id)
    deleted = await sdk.messages.batches.delete(batch.id)
    assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError):
        await sdk.messages.batches.retrieve(batch.id)
    assert (await sdk.messages.batches.list()).data == []
