"""The smallest request the batch lane sends (worker.batch.provider_structs
BatchRequest): a max_tokens of 1 is positive, and a job admitted with it is
sent, as the provider takes it."""

from __future__ import annotations

from shared.story_request import StoryRequest
from worker.batch.provider_structs import BatchRequest


def test_a_max_tokens_of_one_is_a_request() -> None:
    """max_tokens 1 makes a request with max_tokens 1 in its parameters (0 is refused:
    tests/unit/test_batch_requests.py)."""
    story = StoryRequest(prompt="a whale who hums lullabies")
    request = BatchRequest(custom_id="a", request=story, model="claude-test", max_tokens=1)
    assert request.params()["max_tokens"] == 1
