"""A job's request as one request of a batch (worker/batch/provider_structs.py):
what is refused before anything is sent, and what is charged for a result."""

from __future__ import annotations

import msgspec
import pytest

from shared import prompt
from shared.story_request import StoryRequest
from tests.support.batches import batch_requests
from worker.batch.provider_structs import (
    MAX_REQUESTS,
    BatchItemResult,
    BatchRequest,
    ResultKind,
    check_batch,
)

_STORY = StoryRequest(prompt="a whale who hums lullabies")


@pytest.mark.parametrize("custom_id", ["", "a b", "x" * 65, "trailing\n", "é"])
def test_a_custom_id_outside_the_providers_pattern_is_refused(custom_id: str) -> None:
    """BatchRequest refuses a custom_id the provider would refuse (its pattern, whole string)."""
    with pytest.raises(ValueError, match="custom_id"):
        BatchRequest(custom_id=custom_id, request=_STORY, model="claude-test", max_tokens=100)


def test_a_request_needs_a_model_and_positive_max_tokens() -> None:
    """An empty model or a max_tokens below 1 is refused."""
    with pytest.raises(ValueError, match="model"):
        BatchRequest(custom_id="a", request=_STORY, model="", max_tokens=100)
    with pytest.raises(ValueError, match="max_tokens"):
        BatchRequest(custom_id="a", request=_STORY, model="claude-test", max_tokens=0)


def test_a_jobs_stored_request_becomes_the_templates_message() -> None:
    """from_job reads the stored request and params() is the prompt template's system and message, no stream."""
    stored = {"prompt": "a whale who hums lullabies", "age": 4, "length": "short"}
    story = StoryRequest(prompt="a whale who hums lullabies", age=4, length="short")
    request = BatchRequest.from_job("job-7", stored, model="claude-test", max_tokens=800)
    assert request.params() == {
        "model": "claude-test", "max_tokens": 800, "system": prompt.SYSTEM,
        "messages": [{"role": "user", "content": prompt.user_message(story)}]}
    assert request.input_tokens_at_most() == prompt.input_tokens_at_most(story)


def test_a_stored_request_that_no_longer_validates_is_refused() -> None:
    """from_job raises msgspec.ValidationError for a stored request the current rules refuse."""
    with pytest.raises(msgspec.ValidationError):
        BatchRequest.from_job("job-7", {"prompt": "x", "age": 40}, model="claude-test", max_tokens=800)


def test_a_batch_is_checked_as_a_whole_before_it_is_sent() -> None:
    """check_batch refuses no request, a custom_id twice and more than 100,000 requests; it accepts 100,000."""
    with pytest.raises(ValueError, match="at least one"):
        check_batch([])
    with pytest.raises(ValueError, match="twice"):
        check_batch(batch_requests(2) + batch_requests(1))
    one = batch_requests(1)[0]
    many = [msgspec.structs.replace(one, custom_id=f"r{i}") for i in range(MAX_REQUESTS + 1)]
    with pytest.raises(ValueError, match="at most 100000"):
        check_batch(many)
    check_batch(many[:MAX_REQUESTS])


@pytest.mark.parametrize(("reported", "charged"), [
    ((120, 250), (120, 250)),  # as reported
    ((120, 300), (120, 300)),  # exactly max_tokens
    ((120, 301), (120, 300)),  # beyond max_tokens: max_tokens
    ((None, 250), (900, 250)),  # input absent: its bound
    ((120, None), (120, 300)),  # output absent: max_tokens
    ((0, 0), (0, 0)),
])
def test_charged_tokens_are_the_usage_within_the_jobs_worst_case(
    reported: tuple[int | None, int | None], charged: tuple[int, int],
) -> None:
    """charged_tokens keeps a plausible usage, caps output at max_tokens, and charges the worst case for what is absent."""
    result = BatchItemResult(custom_id="a", kind=ResultKind.SUCCEEDED, input_tokens=reported[0],
                             output_tokens=reported[1])
    assert result.charged_tokens(input_tokens_at_most=900, max_tokens=300) == charged
