"""AnthropicBatches through the real anthropic SDK against the fake
provider's faults: what each one raises, what the provider then holds and
billed, and that nothing it sends, however absurd, raises anything else."""

from __future__ import annotations

import socket
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from structlog.testing import capture_logs

from shared import prompt
from shared.pricing import FREE
from shared.status import LlmOutcome
from shared.story_request import StoryRequest
from tests.fakes.anthropic_batches import BatchPlan, FakeBatches, Fault, ItemPlan
from tests.fakes.anthropic_server import FakeAnthropicServer
from tests.support.batches import SettableClock, batch_requests, collect
from tests.support.settings import worker_settings
from worker.anthropic_writer import AnthropicWriter
from worker.batch.anthropic_batches import AnthropicBatches
from worker.batch.anthropic_reading import batch_info
from worker.batch.provider import (
    BatchCreateUnknown,
    BatchNotCreated,
    BatchNotFound,
    BatchUnavailable,
    ResultsInterrupted,
    walk,
)
from worker.batch.provider_structs import (
    BATCH_LIFETIME,
    BatchItemResult,
    BatchRequest,
    BatchState,
    ResultKind,
)
from worker.rows import RetryStart
from worker.writing import JobCall


def _by_id(results: list[BatchItemResult]) -> dict[str, BatchItemResult]:
    return {r.custom_id: r for r in results}


# -- create -------------------------------------------------------------------------------


async def test_a_create_whose_answer_is_dropped_is_unknown_and_the_batch_exists_once(
    provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """A create whose connection closes before any answer raises BatchCreateUnknown; the fake made one batch, sent once, which the list shows."""
    fake.queue(BatchPlan(drop_answer=True))
    with pytest.raises(BatchCreateUnknown, match="may exist"):
        await provider.create(batch_requests(3))
    assert len(fake.creates) == 1 and fake.creates[0].dropped
    (made,) = fake.batches
    assert len(made.items) == 3
    listed = [b async for b in walk(provider, stop=lambda _b: False)]
    assert [(b.id, b.counts.total) for b in listed] == [(made.id, 3)]


async def test_a_create_answered_after_its_timeout_is_unknown_and_the_batch_exists(
    server: FakeAnthropicServer, fake: FakeBatches,
) -> None:
    """A create whose answer comes after create_timeout_s raises BatchCreateUnknown in time; the batch was made."""
    fake.queue(BatchPlan(answer_after_s=10.0))
    provider = AnthropicBatches(api_key="test", base_url=server.base_url, create_timeout_s=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(BatchCreateUnknown):
            await provider.create(batch_requests(2))
        assert time.monotonic() - started < 3.0
    finally:
        await provider.aclose()
    assert len(fake.creates) == 1 and fake.creates[0].batch_id is not None


@pytest.mark.parametrize(("status", "headers", "retryable", "retry_after_s"), [
    (429, (), True, 7.0),
    (529, (), True, 7.0),
    (429, (("x-should-retry", "false"),), False, 7.0),
    (400, (), False, None),
    (413, (), False, None),
])
async def test_a_refused_create_made_no_batch_and_says_whether_to_send_it_again(
    provider: AnthropicBatches, fake: FakeBatches, status: int, headers: tuple[tuple[str, str], ...],
    retryable: bool, retry_after_s: float | None,
) -> None:
    """A 4xx or 529 refusal raises BatchNotCreated: retryable for 429 and 529 (unless x-should-retry: false), with their Retry-After."""
    fake.queue(BatchPlan(status=status, retry_after_s=7 if retry_after_s else None, headers=headers))
    with pytest.raises(BatchNotCreated) as raised:
        await provider.create(batch_requests(2))
    assert raised.value.retryable is retryable
    assert raised.value.retry_after_s == retry_after_s
    assert fake.batches == [] and len(fake.creates) == 1


async def test_a_refusals_retry_after_in_milliseconds_is_read_as_thousandths_of_a_second(
    provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """retry-after-ms, which the provider sends beside retry-after, is the wait in milliseconds: 1500 is 1.5 s."""
    fake.queue(BatchPlan(status=429, headers=(("retry-after-ms", "1500"),)))
    with pytest.raises(BatchNotCreated) as raised:
        await provider.create(batch_requests(2))
    assert raised.value.retry_after_s == 1.5


@pytest.mark.parametrize("made_anyway", [True, False])
async def test_a_create_answered_with_a_5xx_is_unknown_whether_or_not_a_batch_was_made(
    provider: AnthropicBatches, fake: FakeBatches, made_anyway: bool,
) -> None:
    """A 500 to a create raises BatchCreateUnknown, whether the fake made the batch or not: the caller cannot tell."""
    fake.queue(BatchPlan(status=500, made_anyway=made_anyway))
    with pytest.raises(BatchCreateUnknown):
        await provider.create(batch_requests(1))
    assert len(fake.batches) == (1 if made_anyway else 0)


async def test_a_create_answered_without_a_usable_id_is_unknown(provider: AnthropicBatches, fake: FakeBatches) -> None:
    """A 200 whose batch id is missing raises BatchCreateUnknown (the batch exists at the provider)."""
    fake.queue(BatchPlan(answer_patch={"id": None}))
    with pytest.raises(BatchCreateUnknown):
        await provider.create(batch_requests(1))
    assert len(fake.batches) == 1


async def test_a_create_that_cannot_connect_was_not_sent() -> None:
    """A create to a port where nothing listens raises BatchNotCreated, retryable."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    provider = AnthropicBatches(api_key="test", base_url=f"http://127.0.0.1:{port}", create_timeout_s=5.0)
    try:
        with pytest.raises(BatchNotCreated) as raised:
            await provider.create(batch_requests(1))
    finally:
        await provider.aclose()
    assert raised.value.retryable


async def test_the_client_honours_anthropic_base_url(
    server: FakeAnthropicServer, fake: FakeBatches, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no base_url given, the SDK's ANTHROPIC_BASE_URL sends the batch to the fake."""
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.base_url)
    provider = AnthropicBatches(api_key="test", create_timeout_s=5.0)
    try:
        created = await provider.create(batch_requests(1))
    finally:
        await provider.aclose()
    assert [b.id for b in fake.batches] == [created.id]


class _NoHooks:
    """An interactive call's hooks for one call that is not retried."""

    async def next_attempt(self, attempt: int, previous: LlmOutcome, error: str) -> RetryStart:
        raise AssertionError("the call was not to be retried")

    async def rate_limited(self, pause_s: float) -> None:
        raise AssertionError("the call was not to be rate limited")

    def provider_said(self, headers: Any) -> None:
        return None


async def test_each_request_is_the_interactive_call_without_stream(
    server: FakeAnthropicServer, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """A batch request's params are exactly what the interactive writer sends for the same job, less ``stream``."""
    story = StoryRequest(prompt="a snail who collects moonbeams", child_name="Ada", age=5, length="long",
                         language="fr")
    writer = AnthropicWriter(worker_settings(anthropic_api_key="test", anthropic_base_url=server.base_url))
    try:
        await writer.write(story, JobCall(FREE, _NoHooks(), model="claude-test", max_tokens=1234))
    finally:
        await writer.aclose()
    (interactive,) = server.fake.calls
    created = await provider.create([BatchRequest(custom_id="job-1", request=story, model="claude-test",
                                                 max_tokens=1234)])
    (item,) = fake.batch(created.id).items
    assert "stream" not in item.params
    assert item.params == {k: v for k, v in interactive.body.items() if k != "stream"}
    assert item.params["system"] == prompt.SYSTEM and item.params["max_tokens"] == 1234


# -- results ------------------------------------------------------------------------------


@pytest.mark.parametrize("mid_line", [False, True])
async def test_a_results_stream_cut_halfway_raises_and_reading_again_gives_every_result(
    provider: AnthropicBatches, fake: FakeBatches, mid_line: bool,
) -> None:
    """A results stream cut after 3 of 6 lines yields those 3, then ResultsInterrupted; a second read gives all 6."""
    created = await provider.create(batch_requests(6))
    fake.end_batch(created.id)
    fake.queue_fault("results", Fault(after_lines=3, mid_line=mid_line))
    seen: list[BatchItemResult] = []
    with pytest.raises(ResultsInterrupted, match="read them again") as raised:
        async for result in provider.results(created.id):
            seen.append(result)
    assert raised.value.lines_read == 3 and len(seen) == 3
    again = await collect(provider.results(created.id))
    assert sorted(r.custom_id for r in again) == [f"job-{i}" for i in range(6)]
    assert again[:3] == seen


async def test_errored_expired_and_canceled_requests_map_to_our_kinds_and_only_successes_bill(
    provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """Each way a request ends maps to its ResultKind; only an invalid_request_error is final; the fake bills only the success."""
    fake.queue(BatchPlan(items={
        "job-0": ItemPlan(result="errored", error_type="invalid_request_error"),
        "job-1": ItemPlan(result="errored", error_type="api_error"),
        "job-2": ItemPlan(result="errored", error_type="overloaded_error"),
        "job-3": ItemPlan(result="expired"),
        "job-4": ItemPlan(result="canceled"),
        "job-5": ItemPlan(text="Title: The Quiet Pond\nThe frogs hummed softly.", input_tokens=120,
                          output_tokens=9),
    }))
    created = await provider.create(batch_requests(6))
    fake.end_batch(created.id)
    ended = await provider.retrieve(created.id)
    assert (ended.counts.errored, ended.counts.expired, ended.counts.canceled, ended.counts.succeeded) == (3, 1, 1, 1)
    results = _by_id(await collect(provider.results(created.id)))
    assert [results[f"job-{i}"].kind for i in range(6)] == [
        ResultKind.ERRORED, ResultKind.ERRORED, ResultKind.ERRORED, ResultKind.EXPIRED, ResultKind.CANCELED,
        ResultKind.SUCCEEDED]
    assert [results[f"job-{i}"].error_type for i in range(3)] == [
        "invalid_request_error", "api_error", "overloaded_error"]
    assert [results[f"job-{i}"].invalid_request for i in range(6)] == [True] + [False] * 5
    assert [c for c, r in sorted(results.items()) if r.may_be_billed] == ["job-5"]
    story = results["job-5"]
    assert (story.title, story.body, story.input_tokens, story.output_tokens) == (
        "The Quiet Pond", "The frogs hummed softly.", 120, 9)
    assert [b.custom_id for b in fake.billed] == ["job-5"]


async def test_a_cancel_lets_requests_in_progress_succeed_and_bill(provider: AnthropicBatches, fake: FakeBatches) -> None:
    """After a cancel, a request already in progress still succeeds and is billed; the others end canceled."""
    fake.queue(BatchPlan(items={"job-1": ItemPlan(in_progress=True)}))
    created = await provider.create(batch_requests(3))
    assert (await provider.cancel(created.id)).state is BatchState.CANCELING
    assert (await provider.retrieve(created.id)).state is BatchState.CANCELING
    fake.end_batch(created.id)
    ended = await provider.retrieve(created.id)
    assert (ended.state, ended.counts.succeeded, ended.counts.canceled) == (BatchState.ENDED, 1, 2)
    results = _by_id(await collect(provider.results(created.id)))
    assert {c: r.kind for c, r in results.items()} == {
        "job-0": ResultKind.CANCELED, "job-1": ResultKind.SUCCEEDED, "job-2": ResultKind.CANCELED}
    assert [b.custom_id for b in fake.billed] == ["job-1"]


@pytest.mark.parametrize(("input_tokens", "output_tokens"), [
    (-1, -5),
    ("many", "lots"),
    (3e9, 3e9),
    (10**12, 3_000_000_000),
    (True, False),
    (None, None),
    ([1], {"n": 1}),
])
async def test_absurd_usage_never_raises_and_is_charged_as_the_worst_case(
    provider: AnthropicBatches, fake: FakeBatches, input_tokens: object, output_tokens: object,
) -> None:
    """Usage that is negative, not an integer, huge or missing becomes None, and charged_tokens charges the job's worst case."""
    usage: dict[str, Any] = {"input_tokens": input_tokens, "output_tokens": output_tokens}
    fake.queue(BatchPlan(default_item=ItemPlan(result_json={"type": "succeeded", "message": {
        "id": "msg_1", "model": "claude-test", "content": [{"type": "text", "text": "Title: T\nBody."}],
        "usage": usage}})))
    created = await provider.create(batch_requests(1))
    fake.end_batch(created.id)
    with capture_logs() as logs:
        (result,) = await collect(provider.results(created.id))
    assert result.kind is ResultKind.SUCCEEDED
    assert (result.input_tokens, result.output_tokens) == (None, None)
    assert result.charged_tokens(input_tokens_at_most=900, max_tokens=300) == (900, 300)
    odd = [e["what"] for e in logs if e["event"] == "llm.odd_value"]
    assert odd == [w for w, v in (("batch.usage.input_tokens", input_tokens),
                                  ("batch.usage.output_tokens", output_tokens)) if v is not None]


async def test_output_beyond_the_jobs_max_tokens_is_charged_at_max_tokens(
    provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """A plausible output count above the job's max_tokens is charged at max_tokens, the input as reported."""
    fake.queue(BatchPlan(default_item=ItemPlan(input_tokens=700, output_tokens=5000)))
    created = await provider.create(batch_requests(1, max_tokens=300))
    fake.end_batch(created.id)
    (result,) = await collect(provider.results(created.id))
    assert (result.input_tokens, result.output_tokens) == (700, 5000)
    assert result.charged_tokens(input_tokens_at_most=900, max_tokens=300) == (700, 300)


async def test_unreadable_lines_are_skipped_and_an_unknown_kind_may_have_billed(
    provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """A line that is not JSON or names no request is logged and skipped; a result of an unknown type is UNKNOWN, maybe billed."""
    fake.queue(BatchPlan(items={
        "job-0": ItemPlan(line="this is not json"),
        "job-1": ItemPlan(line='{"custom_id": 5, "result": {"type": "succeeded"}}'),
        "job-2": ItemPlan(result_json={"type": "mystery"}),
        "job-3": ItemPlan(result_json={"type": "succeeded", "message": "garbled"}),
    }))
    created = await provider.create(batch_requests(5))
    fake.end_batch(created.id)
    with capture_logs() as logs:
        results = _by_id(await collect(provider.results(created.id)))
    assert sorted(results) == ["job-2", "job-3", "job-4"]
    assert results["job-2"].kind is ResultKind.UNKNOWN and results["job-2"].may_be_billed
    assert results["job-2"].charged_tokens(input_tokens_at_most=900, max_tokens=300) == (900, 300)
    garbled = results["job-3"]
    assert (garbled.kind, garbled.body, garbled.input_tokens) == (ResultKind.SUCCEEDED, "", None)
    assert results["job-4"].kind is ResultKind.SUCCEEDED
    assert sum(e["event"] == "batch.result_unreadable" for e in logs) == 2


async def test_results_of_an_archived_batch_are_not_found(
    provider: AnthropicBatches, fake: FakeBatches, clock: SettableClock,
) -> None:
    """29 days after its creation a batch's results are gone: BatchNotFound."""
    created = await provider.create(batch_requests(1))
    fake.end_batch(created.id)
    clock.advance(30 * 24 * 3600)
    assert (await provider.retrieve(created.id)).archived_at is not None
    with pytest.raises(BatchNotFound):
        await collect(provider.results(created.id))


async def test_a_batch_past_its_day_ends_with_every_request_expired_unbilled(
    provider: AnthropicBatches, fake: FakeBatches, clock: SettableClock,
) -> None:
    """A batch still running when its 24 hours are over ends at its expiry with every request expired, nothing billed."""
    created = await provider.create(batch_requests(3))
    clock.advance(BATCH_LIFETIME.total_seconds() + 1)
    ended = await provider.retrieve(created.id)
    assert (ended.state, ended.counts.expired, ended.ended_at) == (BatchState.ENDED, 3, created.expires_at)
    assert {r.kind for r in await collect(provider.results(created.id))} == {ResultKind.EXPIRED}
    assert fake.billed == []


# -- reads, cancel, delete ----------------------------------------------------------------


@pytest.mark.parametrize("operation", ["retrieve", "list"])
async def test_a_read_whose_answer_is_dropped_is_unavailable_and_the_next_one_works(
    provider: AnthropicBatches, fake: FakeBatches, operation: Any,
) -> None:
    """A retrieve or list whose connection closes without an answer raises BatchUnavailable; asking again works."""
    created = await provider.create(batch_requests(1))
    fake.queue_fault(operation, Fault(drop=True))
    read = (lambda: provider.retrieve(created.id)) if operation == "retrieve" else (lambda: provider.list_page())
    with pytest.raises(BatchUnavailable):
        await read()
    await read()


@pytest.mark.parametrize("status", [429, 500, 529])
async def test_a_read_answered_429_or_5xx_is_unavailable_with_its_retry_after(
    provider: AnthropicBatches, fake: FakeBatches, status: int,
) -> None:
    """A retrieve answered 429, 500 or 529 raises BatchUnavailable carrying the answer's Retry-After."""
    created = await provider.create(batch_requests(1))
    fake.queue_fault("retrieve", Fault(status=status, retry_after_s=12))
    with pytest.raises(BatchUnavailable) as raised:
        await provider.retrieve(created.id)
    assert raised.value.retry_after_s == 12.0


async def test_a_cancel_whose_answer_is_dropped_may_have_cancelled(provider: AnthropicBatches, fake: FakeBatches) -> None:
    """A cancel whose answer is lost raises BatchUnavailable, and a retrieve shows it took effect."""
    created = await provider.create(batch_requests(2))
    fake.queue_fault("cancel", Fault(drop=True))
    with pytest.raises(BatchUnavailable):
        await provider.cancel(created.id)
    after = await provider.retrieve(created.id)
    assert after.cancel_initiated_at is not None and after.counts.canceled == 2


async def test_absurd_batch_fields_never_raise(provider: AnthropicBatches, fake: FakeBatches, clock: SettableClock) -> None:
    """Counts, a state and times that make no sense are logged and replaced: 0, in_progress, now and a day later."""
    created = await provider.create(batch_requests(2))
    fake.queue_fault("retrieve", Fault(patch={
        "request_counts": {"processing": "lots", "succeeded": -3, "errored": 10**9, "canceled": None},
        "processing_status": "pondering", "created_at": "yesterday", "expires_at": 12,
        "ended_at": [1], "cancel_initiated_at": "9999-01-01T00:00:00Z"}))
    with capture_logs() as logs:
        odd = await provider.retrieve(created.id)
    assert odd.id == created.id and odd.state is BatchState.IN_PROGRESS
    assert odd.counts.total == 0
    assert (odd.created_at, odd.expires_at) == (clock.now, clock.now + BATCH_LIFETIME)
    assert (odd.ended_at, odd.cancel_initiated_at) == (None, None)
    assert sorted(e["what"] for e in logs if e["event"] == "llm.odd_value") == [
        "batch.cancel_initiated_at", "batch.created_at", "batch.ended_at", "batch.expires_at",
        "batch.processing_status", "batch.request_counts.errored", "batch.request_counts.processing",
        "batch.request_counts.succeeded"]


async def test_a_retrieve_answered_without_a_usable_id_is_unavailable(
    provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """A retrieve whose answer names no usable batch id raises BatchUnavailable."""
    created = await provider.create(batch_requests(1))
    fake.queue_fault("retrieve", Fault(patch={"id": "../../v1/other"}))
    with pytest.raises(BatchUnavailable):
        await provider.retrieve(created.id)


async def test_an_odd_list_page_is_read_as_far_as_it_can_be(provider: AnthropicBatches, fake: FakeBatches) -> None:
    """A page whose has_more and last_id are garbled still pages on from its own provider."""
    ids = [(await provider.create(batch_requests(1, prefix=f"p{n}"))).id for n in range(3)]
    fake.queue_fault("list", Fault(page_patch={"has_more": "yes", "last_id": 5, "first_id": None}))
    page = await provider.list_page(limit=2)
    assert [b.id for b in page.batches] == ids[:0:-1]
    assert (page.has_more, page.first_id, page.last_id) == (True, ids[2], ids[1])


async def test_a_list_that_repeats_itself_raises_instead_of_looping(
    provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """A provider whose last_id never advances makes walk raise BatchUnavailable rather than loop for ever."""
    ids = [(await provider.create(batch_requests(1, prefix=f"r{n}"))).id for n in range(3)]
    fake.queue_fault("list", *[Fault(page_patch={"last_id": ids[2], "has_more": True})] * 3)
    with pytest.raises(BatchUnavailable, match="repeats"):
        _ = [b async for b in walk(provider, stop=lambda _b: False, page_size=1)]


@pytest.mark.parametrize("batch_id", ["", " msgbatch_1", "msgbatch/1", "x" * 300, 7, None])
def test_a_batch_without_an_id_we_can_send_back_is_not_a_batch(batch_id: object) -> None:
    """An id that is empty, padded, has a slash, is too long or is no string names no batch we could retrieve."""
    assert batch_info({"id": batch_id, "processing_status": "ended"}, datetime.now(UTC)) is None
    assert batch_info({"id": "msgbatch_1", "processing_status": "ended"}, datetime.now(UTC)) is not None


@pytest.mark.parametrize(("ahead_h", "believed"), [(BATCH_LIFETIME.total_seconds() / 3600 + 12, True),
                                                   (BATCH_LIFETIME.total_seconds() / 3600 + 25, False)])
def test_a_batch_time_ahead_of_our_clock_is_believed_within_a_day_of_skew(ahead_h: float, believed: bool) -> None:
    """A batch's expiry is its lifetime after its creation; with our clock up to a day behind the provider's it
    is believed, as it is; further ahead than that it is not, and is replaced by its creation plus the lifetime."""
    now = datetime.now(UTC)
    expires = now + timedelta(hours=ahead_h)
    with capture_logs() as logs:
        info = batch_info({"id": "msgbatch_1", "processing_status": "in_progress", "created_at": now.isoformat(),
                           "expires_at": expires.isoformat()}, now)
    assert info is not None
    assert (info.expires_at == expires) is believed
    assert (info.expires_at == now + BATCH_LIFETIME) is not believed
    assert ("batch.expires_at" in [e.get("what") for e in logs]) is not believed


async def test_an_empty_page_ends_the_walk_whatever_it_says_of_more(
    provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """A page with no batch is the list's end, even when it says there is more and names a cursor: the walk
    stops there instead of paging on from a cursor the page did not show."""
    ids = [(await provider.create(batch_requests(1, prefix=f"e{n}"))).id for n in range(2)]
    fake.queue_fault("list", Fault(page_patch={"data": [], "has_more": True, "last_id": ids[1]}))
    assert [b.id async for b in walk(provider, stop=lambda _b: False, page_size=1)] == []
