"""The offline batch provider: what the lane uses without ANTHROPIC_API_KEY
(``make run`` for a newcomer, demos, tests). No network, nothing billed:
each request's story is the offline writer's deterministic one, and a batch
ends ``delay_s`` after its creation, with the same states, pages, results
and errors as the real provider's batches.

Its batches live in this process's memory only. A worker that restarts has
lost them: every call about one of them then raises BatchNotFound. The lane
must then treat such a batch as expired: nothing of it was billed (offline
bills nothing), and its jobs go into a later batch as new attempts, unbilled.
Ids are random (not a counter), so a batch made after a restart never takes
the id of one that was lost.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from shared import prompt
from shared.config import WorkerSettings
from worker.batch.provider import BatchNotEnded, BatchNotFound, BatchRefused
from worker.batch.provider_structs import (
    BATCH_LIFETIME,
    LIST_LIMIT_MAX,
    BatchCounts,
    BatchInfo,
    BatchItemResult,
    BatchPage,
    BatchRequest,
    BatchState,
    ResultKind,
    check_batch,
)
from worker.offline import OfflineWriter


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass
class _Batch:
    id: str
    number: int
    created_at: datetime
    requests: tuple[BatchRequest, ...]
    ended_at: datetime | None = None
    cancel_initiated_at: datetime | None = None
    # each request's end, by custom_id, once the batch has ended
    results: dict[str, ResultKind] = field(default_factory=dict)


class OfflineBatches:
    provider = "offline"
    model = "offline-writer"
    # nothing leaves the process: a create answers at once
    create_timeout_s = 1.0

    def __init__(self, delay_s: float, *, clock: Callable[[], datetime] = _utcnow) -> None:
        self.delay_s = delay_s
        self._clock = clock
        self._writer = OfflineWriter(delay_s=0)
        self._batches: dict[str, _Batch] = {}

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> OfflineBatches:
        return cls(delay_s=settings.offline_delay_s)

    async def aclose(self) -> None:
        return None

    async def create(self, requests: Sequence[BatchRequest]) -> BatchInfo:
        check_batch(requests)
        batch = _Batch(id=f"offlinebatch_{uuid.uuid4().hex}", number=len(self._batches) + 1,
                       created_at=self._clock(), requests=tuple(requests))
        self._batches[batch.id] = batch
        return self._info(batch)

    async def retrieve(self, batch_id: str) -> BatchInfo:
        return self._info(self._get(batch_id))

    async def list_page(self, *, after_id: str | None = None, before_id: str | None = None,
                        limit: int = 20) -> BatchPage:
        if not 1 <= limit <= LIST_LIMIT_MAX:
            raise ValueError(f"limit {limit} is not within 1..{LIST_LIMIT_MAX}")
        if after_id is not None and before_id is not None:
            raise BatchRefused("list: give after_id or before_id, not both")
        newest_first = sorted(self._batches.values(), key=lambda b: b.number, reverse=True)
        ids = [b.id for b in newest_first]
        cursor = after_id or before_id
        if cursor is not None and cursor not in ids:
            raise BatchRefused(f"list: no batch {cursor} to page from")
        if after_id is not None:
            start = ids.index(after_id) + 1
            page, has_more = newest_first[start:start + limit], start + limit < len(ids)
        elif before_id is not None:
            end = ids.index(before_id)
            start = max(end - limit, 0)
            page, has_more = newest_first[start:end], start > 0
        else:
            page, has_more = newest_first[:limit], limit < len(ids)
        batches = tuple(self._info(b) for b in page)
        return BatchPage(batches=batches, has_more=has_more, first_id=batches[0].id if batches else None,
                         last_id=batches[-1].id if batches else None)

    async def results(self, batch_id: str) -> AsyncIterator[BatchItemResult]:
        batch = self._get(batch_id)
        self._settle(batch)
        if batch.ended_at is None:
            raise BatchNotEnded(f"results of {batch_id}: the batch has not ended")
        # in an order of their own, as a provider gives them: not the requests'
        for request in sorted(batch.requests, key=lambda r: hashlib.sha256(r.custom_id.encode()).digest()):
            yield self._result(request, batch.results[request.custom_id])

    async def cancel(self, batch_id: str) -> BatchInfo:
        batch = self._get(batch_id)
        self._settle(batch)
        if batch.ended_at is not None:
            raise BatchRefused(f"cancel {batch_id}: the batch has ended")
        if batch.cancel_initiated_at is None:
            batch.cancel_initiated_at = self._clock()
        # answered canceling, as a provider does; it has ended at the next look
        return self._info(batch, settle=False)

    async def delete(self, batch_id: str) -> None:
        batch = self._get(batch_id)
        self._settle(batch)
        if batch.ended_at is None:
            raise BatchRefused(f"delete {batch_id}: the batch has not ended; cancel it first")
        del self._batches[batch_id]

    def _get(self, batch_id: str) -> _Batch:
        batch = self._batches.get(batch_id)
        if batch is None:
            raise BatchNotFound(f"no batch {batch_id} in this process (offline batches do not outlive it)")
        return batch

    def _settle(self, batch: _Batch) -> None:
        """Ends the batch if its time has come: its delay, a cancel, or expiry."""
        if batch.ended_at is not None:
            return
        now = self._clock()
        done_at = batch.created_at + timedelta(seconds=self.delay_s)
        expires_at = batch.created_at + BATCH_LIFETIME
        if batch.cancel_initiated_at is not None:
            # a cancel is accepted only before the batch's end: nothing had run
            self._end(batch, batch.cancel_initiated_at, ResultKind.CANCELED)
        elif done_at <= now and done_at < expires_at:
            self._end(batch, done_at, ResultKind.SUCCEEDED)
        elif expires_at <= now:
            self._end(batch, expires_at, ResultKind.EXPIRED)

    def _end(self, batch: _Batch, at: datetime, kind: ResultKind) -> None:
        batch.ended_at = at
        batch.results = {r.custom_id: kind for r in batch.requests}

    def _info(self, batch: _Batch, *, settle: bool = True) -> BatchInfo:
        if settle:
            self._settle(batch)
        if batch.ended_at is not None:
            state = BatchState.ENDED
        elif batch.cancel_initiated_at is not None:
            state = BatchState.CANCELING
        else:
            state = BatchState.IN_PROGRESS
        ended = list(batch.results.values())
        counts = BatchCounts(processing=len(batch.requests) - len(ended),
                             succeeded=ended.count(ResultKind.SUCCEEDED),
                             canceled=ended.count(ResultKind.CANCELED),
                             expired=ended.count(ResultKind.EXPIRED))
        return BatchInfo(id=batch.id, state=state, counts=counts, created_at=batch.created_at,
                         expires_at=batch.created_at + BATCH_LIFETIME, ended_at=batch.ended_at,
                         cancel_initiated_at=batch.cancel_initiated_at)

    def _result(self, request: BatchRequest, kind: ResultKind) -> BatchItemResult:
        if kind is not ResultKind.SUCCEEDED:
            return BatchItemResult(custom_id=request.custom_id, kind=kind)
        title, body = self._writer.compose(request.request)
        return BatchItemResult(
            custom_id=request.custom_id,
            kind=kind,
            title=title,
            body=body,
            model=self.model,
            provider_id=f"offline_{request.custom_id}",
            # what a provider would have counted, as the offline writer says
            input_tokens=len(prompt.user_message(request.request).split()) + len(prompt.SYSTEM.split()),
            output_tokens=len(body.split()),
        )
