"""What an unknown batch result is charged (worker.batch.collector
result_record): the job's worst case, its input bound read from its stored
request; a stored request that no longer validates bounds nothing, and is
charged no input tokens rather than a count below zero."""

from __future__ import annotations

from worker.batch.collector import result_record
from worker.batch.provider_structs import BatchItemResult, ResultKind
from worker.batch.rows import BatchItemRow


def test_an_unknown_result_of_a_request_that_no_longer_validates_is_charged_max_tokens_and_no_input() -> None:
    """Its record carries 0 input tokens and the job's max_tokens of output."""
    item = BatchItemRow(custom_id="sj-1-1-1", job_id=1, attempt=1, request={"no such field": 1}, max_tokens=700,
                        model="claude-test", input_usd_per_mtok=None, output_usd_per_mtok=None)
    record = result_record(BatchItemResult(custom_id="sj-1-1-1", kind=ResultKind.UNKNOWN), item,
                           default_max_tokens=1600)
    assert (record.result, record.input_tokens, record.output_tokens) == ("unknown", 0, 700)
