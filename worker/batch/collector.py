"""Collecting: the batches in flight read back (docs/batches.md).

Every BATCH_POLL_INTERVAL_S each batch in flight is asked what the provider
says of it; one whose jobs all ended elsewhere (or a stray) is cancelled;
an ended one has its results ingested by custom_id, in transactions of
INGEST_CHUNK that a second reading changes nothing of, then is marked read.
A request its ended batch named no result for may have billed: it is
charged as unknown. A batch the provider no longer knows has its unread
requests read as expired (offline: nothing was billed) or unknown.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

import msgspec
import structlog
from opentelemetry.trace import Tracer

from shared import prompt
from shared.config import WorkerSettings
from shared.pricing import BATCH_PRICE_FACTOR
from shared.story_request import StoryRequest
from shared.text import storable
from worker.batch import metrics
from worker.batch.provider import (
    BatchError,
    BatchNotFound,
    BatchProvider,
    BatchRefused,
    ResultsInterrupted,
)
from worker.batch.provider_structs import BatchItemResult, ResultKind
from worker.batch.rows import BatchItemRow, Lease, LiveBatch, ResultRecord
from worker.batch.store import BatchStore
from worker.batch.tick import TickResult, links

log = structlog.get_logger()

# results ingested per transaction
INGEST_CHUNK = 100


class Collector:
    """Polls the batches in flight and ingests their results, for the lease's holder."""

    def __init__(self, settings: WorkerSettings, store: BatchStore, provider: BatchProvider, tracer: Tracer,
                 clock: Callable[[], float]) -> None:
        self.settings = settings
        self._store = store
        self._provider = provider
        self._tracer = tracer
        self._clock = clock
        # when each batch in flight was last looked at, in this process
        self._polled_at: dict[int, float] = {}
        # the offline provider bills nothing
        self._free = provider.provider == "offline"

    def poll_due(self, batch: LiveBatch) -> bool:
        last = self._polled_at.get(batch.id)
        return last is None or self._clock() - last >= self.settings.batch_poll_interval_s

    async def collect(self, fence: Lease, batch: LiveBatch, result: TickResult) -> None:
        assert batch.provider_batch_id is not None
        self._polled_at[batch.id] = self._clock()
        try:
            info = await self._provider.retrieve(batch.provider_batch_id)
        except BatchNotFound:
            # the provider no longer knows it. The offline provider after a
            # restart: nothing of it was billed there. A real provider (the
            # batch deleted by someone): its requests may have been billed
            kind = ResultKind.EXPIRED if self._provider.provider == "offline" else ResultKind.UNKNOWN
            await self._ingest_missing(fence, batch, kind, result)
            return
        except BatchError as exc:
            log.info("batch.retrieve_unavailable", batch=batch.id, error=exc.message)
            return
        await self._store.seen(fence, batch.id, processing_status=info.state.value,
                               request_counts=msgspec.structs.asdict(info.counts), expires_at=info.expires_at)
        if not info.ended:
            if (batch.abandoned or batch.state == "stray") and batch.cancel_asked_at is None:
                await self._cancel(fence, batch)
            return
        await self._ingest(fence, batch, result)

    async def _cancel(self, fence: Lease, batch: LiveBatch) -> None:
        assert batch.provider_batch_id is not None
        try:
            await self._provider.cancel(batch.provider_batch_id)
        except BatchRefused:
            pass  # it ended meanwhile: its results are read at the next look
        except BatchError as exc:
            log.info("batch.cancel_unavailable", batch=batch.id, error=exc.message)
            return
        await self._store.cancel_asked(fence, batch.id)
        log.info("batch.cancel_asked", batch=batch.id, provider_batch_id=batch.provider_batch_id,
                 stray=batch.state == "stray")

    async def _ingest(self, fence: Lease, batch: LiveBatch, result: TickResult) -> None:
        assert batch.provider_batch_id is not None
        owner = _owner(batch)
        items = {item.custom_id: item for item in await self._store.items_of(owner)}
        every = dict(items)
        chunk: list[ResultRecord] = []
        try:
            async for item_result in self._provider.results(batch.provider_batch_id):
                item = items.pop(item_result.custom_id, None)
                if item is None:
                    continue  # read before, or not a request of ours
                chunk.append(self._record(item_result, item))
                if len(chunk) >= INGEST_CHUNK:
                    await self._ingest_chunk(fence, owner, chunk, result, [every[r.custom_id] for r in chunk])
                    chunk = []
        except (ResultsInterrupted, BatchError) as exc:
            # what was ingested stays; the rest is read again next time
            if chunk:
                await self._ingest_chunk(fence, owner, chunk, result, [every[r.custom_id] for r in chunk])
            log.info("batch.results_interrupted", batch=batch.id, error=exc.message)
            return
        if chunk:
            await self._ingest_chunk(fence, owner, chunk, result, [every[r.custom_id] for r in chunk])
        if batch.state == "stray":
            await self._store.stray_read(fence, batch.id)
            return
        # a request the results did not name may have billed: charged as unknown
        if items:
            missing = [self._record(BatchItemResult(custom_id=c, kind=ResultKind.UNKNOWN,
                                                    error_message="its batch ended with no result for it"), item)
                       for c, item in items.items()]
            for start in range(0, len(missing), INGEST_CHUNK):
                part = missing[start:start + INGEST_CHUNK]
                await self._ingest_chunk(fence, owner, part, result, [every[r.custom_id] for r in part])
        if await self._store.results_read(fence, batch.id):
            metrics.BATCHES.labels(event="read").inc()
            log.info("batch.results_read", batch=batch.id, provider_batch_id=batch.provider_batch_id)

    async def _ingest_missing(self, fence: Lease, batch: LiveBatch, kind: ResultKind, result: TickResult) -> None:
        owner = _owner(batch)
        if batch.state == "stray":
            await self._store.stray_read(fence, batch.id)
            return
        items = await self._store.items_of(owner)
        records = [self._record(BatchItemResult(custom_id=item.custom_id, kind=kind,
                                                error_message="the provider no longer knows its batch"), item)
                   for item in items]
        for start in range(0, len(records), INGEST_CHUNK):
            await self._ingest_chunk(fence, owner, records[start:start + INGEST_CHUNK], result,
                                     items[start:start + INGEST_CHUNK])
        await self._store.results_read(fence, batch.id)
        log.warning("batch.not_found", batch=batch.id, provider_batch_id=batch.provider_batch_id,
                    requests=len(records), detail=f"its unread requests were read as {kind.value}")

    def _record(self, item_result: BatchItemResult, item: BatchItemRow) -> ResultRecord:
        return result_record(item_result, item, default_max_tokens=self.settings.llm_max_tokens)

    async def _ingest_chunk(self, fence: Lease, owner: int, chunk: list[ResultRecord], result: TickResult,
                            items: Sequence[BatchItemRow] = ()) -> None:
        with self._tracer.start_as_current_span("storyjobs.batch.ingest", links=links(i.trace_context for i in items),
                                                attributes={"storyjobs.batch.id": owner,
                                                            "storyjobs.batch.results": len(chunk)}):
            answer = await self._store.ingest(fence, owner, chunk, max_attempts=self.settings.batch_max_attempts,
                                              free=self._free)
        result.completed += answer.completed
        result.failed += answer.failed
        result.waiting += answer.waiting
        for record in chunk:
            metrics.REQUESTS.labels(result=record.result).inc()
        if answer.cost_usd:
            metrics.COST.inc(float(answer.cost_usd))
            metrics.SAVED.inc(float(answer.cost_usd * (1 - BATCH_PRICE_FACTOR) / BATCH_PRICE_FACTOR))
        if answer.completed or answer.failed or answer.billed_unseen:
            log.info("batch.results_ingested", batch=owner, read=answer.read, completed=answer.completed,
                     failed=answer.failed, waiting=answer.waiting, billed_unseen=answer.billed_unseen,
                     cost_usd=str(answer.cost_usd))


def _owner(batch: LiveBatch) -> int:
    """The batch whose items a batch's results answer: a stray's are the
    lost intent's it may be."""
    return batch.lost_batch_id if batch.state == "stray" and batch.lost_batch_id else batch.id


def _bounds(item: BatchItemRow, default_max_tokens: int) -> tuple[int, int]:
    """The job's input tokens' bound and its max_tokens."""
    max_tokens = item.max_tokens or default_max_tokens
    try:
        request = msgspec.convert(item.request, StoryRequest)
    except msgspec.ValidationError:
        return 0, max_tokens
    return prompt.input_tokens_at_most(request), max_tokens


def result_record(item_result: BatchItemResult, item: BatchItemRow, *, default_max_tokens: int) -> ResultRecord:
    """One provider result as batch_results_ingest takes it, its tokens the
    ones the ledger charges: the reported usage for a success, the job's
    worst case for a result of unknown kind (``default_max_tokens``: for a
    job admitted with none)."""
    at_most, max_tokens = _bounds(item, default_max_tokens)
    kind = item_result.kind
    if kind in (ResultKind.SUCCEEDED, ResultKind.UNKNOWN):
        input_tokens, output_tokens = (item_result.charged_tokens(input_tokens_at_most=at_most,
                                                                   max_tokens=max_tokens)
                                       if kind is ResultKind.SUCCEEDED else (at_most, max_tokens))
        title, body = item_result.title, item_result.body
        if kind is ResultKind.SUCCEEDED and not body.strip():
            # billed, and nothing to show for it: the job fails as llm_error
            return ResultRecord(custom_id=item.custom_id, result="unknown", input_tokens=input_tokens,
                                output_tokens=output_tokens, request_id=item_result.provider_id,
                                error_text="the batch's answer had no story text")
        return ResultRecord(
            custom_id=item.custom_id, result=kind.value, story_id=str(uuid.uuid4()),
            title=storable(title), body=storable(body), model=storable(item_result.model or item.model or ""),
            prompt_version=prompt.PROMPT_VERSION, input_tokens=input_tokens, output_tokens=output_tokens,
            request_id=item_result.provider_id,
            error_text=None if kind is ResultKind.SUCCEEDED else storable(
                "its result could not be read, so it may have been billed: "
                f"{item_result.error_message or 'no detail'}"[:500]))
    detail = item_result.error_message or item_result.error_type or kind.value
    return ResultRecord(custom_id=item.custom_id, result=kind.value, rejected=item_result.invalid_request,
                        request_id=item_result.provider_id,
                        error_text=storable(f"the batch's request ended {kind.value}: {detail}"[:500]))
