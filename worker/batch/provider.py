"""The seam between the batch lane and a provider's batch API.

The lane sees only what is here: a ``BatchProvider``, the Structs it
takes and returns (worker/batch/provider_structs.py: our own,
provider-neutral) and the errors it raises. Each error says what the
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
before it reaches one of those Structs; none of it can raise anything but these
errors. A usage count that is absent or absurd arrives as None, and
``BatchItemResult.charged_tokens`` charges the job's worst case for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from worker.batch.provider_structs import (
    LIST_LIMIT_MAX,
    BatchInfo,
    BatchItemResult,
    BatchPage,
    BatchRequest,
)


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
