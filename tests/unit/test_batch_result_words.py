"""What a batch result's record says in words (worker.batch.collector
result_record), which its job's poll and its ledger row show: an unreadable
result says it may have been billed and why; a story says nothing, for nothing
went wrong."""

from __future__ import annotations

from worker.batch.collector import result_record
from worker.batch.provider_structs import BatchItemResult, ResultKind
from worker.batch.rows import BatchItemRow

ITEM = BatchItemRow(custom_id="sj-1-1-1", job_id=1, attempt=1, request={"prompt": "an owl"}, max_tokens=700,
                    model="claude-test", input_usd_per_mtok=None, output_usd_per_mtok=None)


def test_an_unreadable_result_says_it_may_have_been_billed_and_why() -> None:
    record = result_record(BatchItemResult(custom_id="sj-1-1-1", kind=ResultKind.UNKNOWN,
                                           error_message="the line was not JSON"), ITEM, default_max_tokens=1600)
    assert record.result == "unknown"
    assert record.error_text == "its result could not be read, so it may have been billed: the line was not JSON"


def test_a_story_carries_no_error_words() -> None:
    record = result_record(BatchItemResult(custom_id="sj-1-1-1", kind=ResultKind.SUCCEEDED, title="The Owl",
                                           body="Once upon a time.", input_tokens=10, output_tokens=20),
                           ITEM, default_max_tokens=1600)
    assert (record.result, record.title, record.error_text) == ("succeeded", "The Owl", None)


def test_a_story_without_text_is_no_story_and_says_so() -> None:
    """A success whose answer holds no text was billed for nothing to show: its job fails, never completes
    with an empty story."""
    record = result_record(BatchItemResult(custom_id="sj-1-1-1", kind=ResultKind.SUCCEEDED, title="The Owl",
                                           body=" \n ", input_tokens=10, output_tokens=20),
                           ITEM, default_max_tokens=1600)
    assert (record.result, record.story_id, record.error_text) == ("unknown", None,
                                                                  "the batch's answer had no story text")
