"""The seam between the batch lane and a provider's batch API.

The lane sees only what is here: a ``BatchProvider``, the Structs it
returns (our own, provider-neutral: the lane stores and compares them,
never the SDK's types) and the errors it raises. Each error says what the
lane may conclude about money:

* ``create``: only ``BatchNotCreated`` says that no batch was made (the
  provider refused the request, or no connection was made). Any other
  exception, ``BatchCreateUnknown`` or one of ours, means a batch may exist
  and bill: the lane reconciles by walking the list from its intent's fence,
  and never creates the same requests again blindly.
* ``retrieve``, ``list_page``, ``results``: ``BatchUnavailable`` (no usable
  answer: try again later), ``BatchNotFound`` (the provider does not know the
  batch: deleted, or lost with an OfflineBatches' process), ``BatchRefused``
  (the provider said no to this request; ``BatchNotEnded`` for results asked
  too early), ``ResultsInterrupted`` (the results stream broke after some
  lines: read again from the start; results are keyed by ``custom_id``, so
  ingesting them twice must change nothing).
* ``cancel``, ``delete``: ``BatchUnavailable`` means it may or may not have
  happened: retrieve the batch to know.

Every number and time a provider sends is checked by the implementation
before it reaches a Struct here; none of it can raise anything but these
errors. A usage count that is absent or absurd arrives as None, and
``BatchItemResult.charged_tokens`` charges the job's worst case for it.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol

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


class BatchError(Exception):
    """A batch call that did not give its answer."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class BatchNotCreated(BatchError):
    """The create certainly made no batch: the provider refused it before
    any work, or no connection was made. ``retryable``: the same requests
    may be sent again later (rate limited, overloaded, no connection);
    otherwise the provider refused them as they are."""

    def __init__(self, message: str, *, retryable: bool, retry_after_s: float | None = None) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.retryable = retryable


class BatchCreateUnknown(BatchError):
    """The create's answer was lost (timeout, dropped connection, a 5xx, an
    unreadable answer): a batch may exist. Reconcile by listing."""


class BatchUnavailable(BatchError):
    """No usable answer (timeout, dropped connection, 429, 5xx, an
    unreadable answer): nothing is known; try again later. For cancel and
    delete, it may or may not have happened."""


class BatchNotFound(BatchError):
    """The provider does not know this batch (deleted, or never made there)."""


class BatchRefused(BatchError):
    """The provider refused this request as it is (a 4xx): e.g. deleting a
    batch that has not ended, or cancelling one that has."""


class BatchNotEnded(BatchRefused):
    """Results were asked of a batch that has not ended."""


class ResultsInterrupted(BatchError):
    """The results stream broke after ``lines_read`` whole lines (their
    results were yielded; unreadable ones skipped). Read the results again
    from the start: the provider serves them whole again."""

    def __init__(self, message: str, *, lines_read: int) -> None:
        super().__init__(message)
        self.lines_read = lines_read


class BatchProvider(Protocol):
    """A provider's Message Batches API. No call is retried inside: each
    call sends at most one request of its kind (``results`` reads the batch
    first), and the caller decides from the error what to do next."""

    provider: str
    # the longest a create call can take before it raises; a submitter's
    # lease must outlast it
    create_timeout_s: float

    async def create(self, requests: Sequence[BatchRequest]) -> BatchInfo:
        """Sends one batch. Raises ValueError (nothing sent) for what
        check_batch refuses; BatchNotCreated when certainly nothing was made;
        BatchCreateUnknown when a batch may exist."""
        ...

    async def retrieve(self, batch_id: str) -> BatchInfo: ...

    async def list_page(self, *, after_id: str | None = None, before_id: str | None = None,
                        limit: int = 20) -> BatchPage:
        """One page of every batch of the workspace (ours and anyone
        else's), newest first; ``limit`` 1..1000 (ValueError otherwise)."""
        ...

    def results(self, batch_id: str) -> AsyncIterator[BatchItemResult]:
        """The results of an ended batch, one per request, in the provider's
        order (not the requests'). Nothing is asked before the first
        iteration, so every error above comes from ``async for``. A line that
        names no request cannot be given to anyone: it is logged and skipped,
        so a request without a result after a whole read has an unknown
        outcome (it may have billed)."""
        ...

    async def cancel(self, batch_id: str) -> BatchInfo:
        """Asks the batch to stop: it goes ``canceling`` then ``ended``;
        requests not yet run end ``canceled``, those in progress may still
        succeed and bill."""
        ...

    async def delete(self, batch_id: str) -> None:
        """Deletes an ended batch and its results (BatchRefused before it ended)."""
        ...

    async def aclose(self) -> None: ...


async def walk(provider: BatchProvider, *, stop: Callable[[BatchInfo], bool],
               page_size: int = LIST_LIMIT_MAX) -> AsyncIterator[BatchInfo]:
    """Every batch, newest first, page after page (``after_id`` = the last
    page's ``last_id``), until ``stop(batch)`` is true for one (not yielded:
    the list is ordered by creation, so e.g. ``created_at`` below a fence
    ends the walk) or the list ends. A provider whose list does not advance
    raises BatchUnavailable rather than looping."""
    after_id: str | None = None
    cursors: set[str] = set()
    while True:
        page = await provider.list_page(after_id=after_id, limit=page_size)
        for batch in page.batches:
            if stop(batch):
                return
            yield batch
        if not page.has_more or not page.batches or page.last_id is None:
            return
        if page.last_id in cursors:
            raise BatchUnavailable(f"the batch list repeats itself after {page.last_id}")
        cursors.add(page.last_id)
        after_id = page.last_id
