"""What crosses the seam between the batch lane and a provider
(worker/batch/provider.py): our own provider-neutral Structs, which the lane
stores and compares (never the SDK's types). ``BatchRequest`` is one job's
request in a batch, checked before anything is sent (``check_batch``);
``BatchInfo``, ``BatchPage`` and ``BatchItemResult`` are what a provider
answers, every value already checked by the implementation. Also the
provider's documented limits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

import msgspec

from shared import prompt
from shared.story_request import StoryRequest

# what the provider accepts in one batch (Anthropic's documented limits; the
# 256 MB bound on a batch's size is far above BATCH_MAX_REQUESTS stories)
CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_REQUESTS = 100_000
LIST_LIMIT_MAX = 1000
# a batch ends, at the latest, this long after its creation
BATCH_LIFETIME = timedelta(hours=24)
# no prompt of ours comes near this many input tokens: a larger count is absurd
INPUT_TOKENS_MAX = 1_000_000


class BatchState(StrEnum):
    IN_PROGRESS = "in_progress"
    CANCELING = "canceling"  # a cancel was asked; requests in progress may still succeed and bill
    ENDED = "ended"  # every request has a result; results can be read


class BatchCounts(msgspec.Struct, frozen=True, kw_only=True):
    """Requests by state. Only ``processing`` counts until the whole batch
    ends; then the other four, which add up to the batch's size."""

    processing: int = 0
    succeeded: int = 0
    errored: int = 0
    canceled: int = 0
    expired: int = 0

    @property
    def total(self) -> int:
        return self.processing + self.succeeded + self.errored + self.canceled + self.expired


class BatchInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A batch as the provider last described it. Times are aware (UTC)."""

    id: str
    state: BatchState
    counts: BatchCounts
    created_at: datetime
    # when it ends at the latest, its unfinished requests then expired
    expires_at: datetime
    ended_at: datetime | None = None
    cancel_initiated_at: datetime | None = None
    # its results are gone from then on
    archived_at: datetime | None = None

    @property
    def ended(self) -> bool:
        return self.state is BatchState.ENDED


class BatchPage(msgspec.Struct, frozen=True, kw_only=True):
    """One page of the list, newest first. ``has_more``: more batches lie
    beyond it in the direction asked (older after ``after_id`` or with no
    cursor; newer before ``before_id``)."""

    batches: tuple[BatchInfo, ...]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


class ResultKind(StrEnum):
    SUCCEEDED = "succeeded"  # billed: the story is in the result
    ERRORED = "errored"  # not billed; ``error_type`` says why
    CANCELED = "canceled"  # not billed: the batch was cancelled before it ran
    EXPIRED = "expired"  # not billed: the batch's 24 hours ran out before it ran
    # a result whose kind could not be read: it may have been billed, so the
    # lane must neither send it again nor charge it less than its worst case
    UNKNOWN = "unknown"


INVALID_REQUEST_ERROR = "invalid_request_error"


class BatchItemResult(msgspec.Struct, frozen=True, kw_only=True):
    """How one request of an ended batch ended. Text is storable (no NUL, no
    lone surrogate); a title is always there for a success (the template's
    fallback when the model wrote none), the body may be empty."""

    custom_id: str
    kind: ResultKind
    title: str = ""
    body: str = ""
    model: str | None = None
    # the provider's id of the message (succeeded) or of the request (errored)
    provider_id: str | None = None
    # None: absent or absurd; charged_tokens then charges the worst case
    input_tokens: int | None = None
    output_tokens: int | None = None
    error_type: str | None = None
    error_message: str | None = None

    @property
    def may_be_billed(self) -> bool:
        return self.kind in (ResultKind.SUCCEEDED, ResultKind.UNKNOWN)

    @property
    def invalid_request(self) -> bool:
        """The provider found the request itself wrong: sending it again cannot help."""
        return self.kind is ResultKind.ERRORED and self.error_type == INVALID_REQUEST_ERROR

    def charged_tokens(self, *, input_tokens_at_most: int, max_tokens: int) -> tuple[int, int]:
        """(input, output) tokens the ledger charges: the reported usage,
        never above the job's max_tokens; where a count is absent or absurd,
        the job's worst case (as the interactive writer does)."""
        input_tokens = input_tokens_at_most if self.input_tokens is None else self.input_tokens
        output = self.output_tokens
        return input_tokens, max_tokens if output is None or output > max_tokens else output


class BatchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One job's request in a batch: its stored request through the same
    prompt template as the interactive call, on the job's model and
    max_tokens (what admission reserved), never streamed."""

    custom_id: str
    request: StoryRequest
    model: str
    max_tokens: int

    def __post_init__(self) -> None:
        if not CUSTOM_ID.fullmatch(self.custom_id):
            raise ValueError(f"custom_id {self.custom_id!r} does not match ^[a-zA-Z0-9_-]{{1,64}}$")
        if not self.model:
            raise ValueError("model is empty")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens {self.max_tokens} is not positive")

    @classmethod
    def from_job(cls, custom_id: str, stored_request: Mapping[str, Any], *, model: str,
                 max_tokens: int) -> BatchRequest:
        """From a job's stored request; raises msgspec.ValidationError when
        it no longer validates (the job then fails as ``invalid_request``,
        unbilled, as the interactive executor does)."""
        return cls(custom_id=custom_id, request=msgspec.convert(dict(stored_request), StoryRequest),
                   model=model, max_tokens=max_tokens)

    def params(self) -> dict[str, Any]:
        """The Messages API parameters: what the interactive writer sends, without ``stream``."""
        return {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "system": prompt.SYSTEM,
            "messages": [{"role": "user", "content": prompt.user_message(self.request)}],
        }

    def input_tokens_at_most(self) -> int:
        return prompt.input_tokens_at_most(self.request)


def check_batch(requests: Sequence[BatchRequest]) -> None:
    """Raises ValueError, before anything is sent, for what the provider
    would refuse as a whole: no request, too many, a custom_id twice."""
    if not requests:
        raise ValueError("a batch needs at least one request")
    if len(requests) > MAX_REQUESTS:
        raise ValueError(f"a batch holds at most {MAX_REQUESTS} requests, not {len(requests)}")
    seen: set[str] = set()
    for request in requests:
        if request.custom_id in seen:
            raise ValueError(f"custom_id {request.custom_id!r} appears twice in one batch")
        seen.add(request.custom_id)
