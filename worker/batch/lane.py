"""The batch lane: a story within the day at half the price, billed once
whatever is lost (docs/batches.md).

``BatchLane.run()`` repeats ``tick_once()`` until stopped. A tick does
nothing unless this worker holds the submitter's lease (batch_leases: one
holder at a time in the whole system, passed on when it runs out). The
holder, in one tick:

1. reconciles an intent whose create call was not answered: it walks the
   provider's list newest first down to the intent's fence (less a clock
   margin) and adopts the one batch it does not know whose request count
   is the intent's; none within BATCH_RECONCILE_GRACE_S, the intent is lost
   and its jobs fail as calls of unknown outcome, charged their worst case.
   For a day after an intent is lost, any batch of the workspace it does
   not know is recorded as a stray: cancelled, and its results charged by
   custom_id. A create is never sent again blindly;
2. collects the batches in flight every BATCH_POLL_INTERVAL_S: what the
   provider says of each, a cancel for one whose jobs all ended elsewhere,
   and for an ended one its results, ingested by custom_id in transactions
   that a second reading changes nothing of;
3. submits when BATCH_MAX_REQUESTS jobs wait or the oldest has waited
   BATCH_COLLECT_S, and no intent is unresolved: the intent (jobs moved
   into it, items, ledger rows) committed under the renewed lease, then one
   create call with no retry.

Crash-only: killed at any line, the lease runs out and the next holder
finds in the database everything it needs (an unresolved intent is
reconciled, a batch in flight collected). Database errors are logged once
per episode and waited out with the worker's backoff; a provider that does
not answer is asked again at the next tick.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import msgspec
import structlog
from opentelemetry import trace
from opentelemetry.trace import Link, Tracer

from shared import db, prompt, telemetry
from shared.config import WorkerSettings
from shared.pricing import BATCH_PRICE_FACTOR
from shared.story_request import StoryRequest
from shared.text import storable
from worker.backoff import Backoff
from worker.batch import metrics
from worker.batch.provider import (
    BatchCreateUnknown,
    BatchError,
    BatchInfo,
    BatchItemResult,
    BatchNotCreated,
    BatchNotFound,
    BatchProvider,
    BatchRefused,
    BatchRequest,
    ResultKind,
    ResultsInterrupted,
    walk,
)
from worker.batch.rows import BatchItemRow, Intent, Lease, LeaseTaken, LiveBatch, ResultRecord
from worker.batch.store import BatchStore

log = structlog.get_logger()

# clocks differ: the provider's created_at of a batch made just after our
# fence may read up to this much earlier
FENCE_MARGIN = timedelta(minutes=5)
# how long a lost intent's batch may still turn up: a create is answered, at
# the latest, well within a day
STRAY_WINDOW = timedelta(hours=24)
# results ingested per transaction
INGEST_CHUNK = 100
# the lease outlasts a create call by this much, so that a holder never sends
# under a lease that can run out before the call ends
LEASE_MARGIN_S = 30.0
# the links a span keeps (the SDK's default OTEL_SPAN_LINK_COUNT_LIMIT)
_LINKS_MAX = 128
# how often a worker that does not hold the lease asks for it
_STANDBY_S = 30.0


@dataclass
class TickResult:
    """What one tick did (counted and logged once, here)."""

    holding: bool = False
    submitted: int = 0  # requests in the batch created
    adopted: int = 0  # intents reconciled to a batch found at the provider
    lost: int = 0  # intents given up: their jobs failed as unknown
    strays: int = 0
    refused: int = 0  # creates the provider refused before anything was made
    completed: int = 0
    failed: int = 0
    waiting: int = 0  # jobs put back to wait for a later batch
    database_error: str | None = None


@dataclass
class _Seen:
    """When each batch in flight was last looked at, in this process."""

    polled_at: dict[int, float] = field(default_factory=dict)


class BatchLane:
    def __init__(self, settings: WorkerSettings, store: BatchStore, provider: BatchProvider, *,
                 holder: str | None = None, clock: Callable[[], float] = time.monotonic,
                 tracer: Tracer | None = None) -> None:
        self.settings = settings
        # traces on: the create and each ingestion a span, linked to the jobs' traces
        self._tracer = tracer or trace.get_tracer("storyjobs.worker.batch")
        self._store = store
        self._provider = provider
        self.holder = holder or f"lane-{uuid.uuid4().hex[:12]}"
        self._clock = clock
        self._lease: LeaseTaken | None = None
        self._seen = _Seen()
        self._stopping = asyncio.Event()
        self._errors = db.ErrorEpisode("batch", clock=clock, task="lane")
        self._backoff = Backoff()
        # the offline provider bills nothing
        self._free = provider.provider == "offline"

    @property
    def lease_s(self) -> float:
        """Longer than a create call can take, with a margin: a holder
        renews it just before it creates, so it cannot run out mid-call."""
        return 2 * self._provider.create_timeout_s + LEASE_MARGIN_S

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        log.info("batch.lane_started", holder=self.holder, provider=self._provider.provider,
                 collect_s=self.settings.batch_collect_s, poll_interval_s=self.settings.batch_poll_interval_s)
        try:
            while not self._stopping.is_set():
                result = await self.tick_once()
                if result.database_error:
                    wait_s = self._backoff.next_s()
                elif result.holding:
                    wait_s = self._tick_s
                else:
                    # another worker holds the lease: it is worth asking again
                    # well before it could run out, never in a hurry
                    wait_s = max(self._tick_s, min(_STANDBY_S, self.lease_s / 3))
                try:
                    async with asyncio.timeout(wait_s):
                        await self._stopping.wait()
                except TimeoutError:
                    pass
        finally:
            await self._release()
            log.info("batch.lane_stopped", holder=self.holder)

    @property
    def lease(self) -> Lease | None:
        """The lease the last tick took (None: it took none), which every
        write of the holder checks."""
        return None if self._lease is None else Lease(self.holder, self._lease.token)

    @property
    def _fence(self) -> Lease:
        lease = self.lease
        assert lease is not None
        return lease

    @property
    def _tick_s(self) -> float:
        """Often enough to submit within a tenth of BATCH_COLLECT_S of its
        end and to poll on time; at least a second."""
        return max(1.0, min(self.settings.batch_collect_s / 10, self.settings.batch_poll_interval_s / 2))

    async def _release(self) -> None:
        if self._lease is None:
            return
        try:
            await self._store.lease_release(self._fence)
        except db.DB_ERRORS as exc:
            # it runs out by itself
            log.warning("batch.lease_release_failed", error=db.describe(exc))
        self._lease = None

    # -- one tick ----------------------------------------------------------------------

    async def tick_once(self) -> TickResult:
        result = TickResult()
        try:
            self._lease = await self._store.lease_take(self.holder, self.lease_s)
            if self._lease is None:
                # the holder reports the batches in flight; a former holder's
                # figures would otherwise stay, stale, beside the new one's
                metrics.set_in_flight(())
                return result
            result.holding = True
            live = await self._store.live()
            metrics.set_in_flight(live)
            intents = [b for b in live if b.state == "intent"]
            lost = [b for b in live if b.state == "lost"]
            if intents or lost:
                await self._reconcile(intents, lost, result)
            for batch in live:
                if batch.state in ("sent", "stray") and self._poll_due(batch):
                    await self._collect(batch, result)
            if not intents:
                await self._submit_if_due(result)
        except db.DB_ERRORS as exc:
            self._errors.failed(exc, holder=self.holder)
            result.database_error = db.describe(exc)
            return result
        self._errors.succeeded()
        self._backoff.reset()
        return result

    def _poll_due(self, batch: LiveBatch) -> bool:
        last = self._seen.polled_at.get(batch.id)
        return last is None or self._clock() - last >= self.settings.batch_poll_interval_s

    # -- submitting ---------------------------------------------------------------------

    async def _submit_if_due(self, result: TickResult) -> None:
        summary = await self._store.ready_summary(self.settings.batch_max_requests)
        due = summary.ready >= self.settings.batch_max_requests or (
            summary.ready > 0 and summary.oldest_s >= self.settings.batch_collect_s)
        if not due or self._lease is None:
            return
        intent = await self._store.intent_create(
            self._fence, self.lease_s, max_requests=self.settings.batch_max_requests,
            model=self.settings.llm_model, provider=self._provider.provider)
        if intent is None:
            return
        requests = await self._requests(intent)
        if not requests:
            # every request of it was dropped: nothing to send, nothing to reconcile
            await self._store.refused(self._fence, intent.id, outcome="not_sent", error_code="invalid_request",
                                      error_text="no request of the batch could be sent",
                                      max_attempts=self.settings.batch_max_attempts)
            return
        # the lease renewed just before the call: a holder whose lease ran
        # out never sends (another may be reconciling this very intent)
        renewed = await self._store.lease_take(self.holder, self.lease_s)
        if renewed is None or renewed.token != self._lease.token:
            log.warning("batch.lease_lost_before_create", batch=intent.id)
            answer = await self._store.refused(self._fence, intent.id, outcome="not_sent", error_code="llm_unavailable",
                                               error_text="the lane lost its lease before the batch was sent",
                                               max_attempts=self.settings.batch_max_attempts + len(requests))
            result.waiting += answer.waiting
            return
        await self._create(intent, requests, result)

    async def _requests(self, intent: Intent) -> list[BatchRequest]:
        """Each item's request; a stored request that no longer validates is
        failed (unbilled) and dropped from the intent before anything is sent."""
        requests, invalid = [], []
        for item in intent.items:
            try:
                requests.append(BatchRequest.from_job(item.custom_id, item.request,
                                                      model=item.model or self.settings.llm_model,
                                                      max_tokens=item.max_tokens or self.settings.llm_max_tokens))
            except (msgspec.ValidationError, ValueError) as exc:
                log.error("batch.request_invalid", job_id=item.job_id, error=str(exc))
                invalid.append(item.job_id)
        if invalid:
            await self._store.items_drop(self._fence, intent.id, invalid, "the stored request is not valid")
        return requests

    async def _create(self, intent: Intent, requests: Sequence[BatchRequest], result: TickResult) -> None:
        links = _links(item.trace_context for item in intent.items)
        with self._tracer.start_as_current_span("storyjobs.batch.create", links=links, attributes={
                "storyjobs.batch.id": intent.id, "storyjobs.batch.requests": len(requests)}):
            await self._create_traced(intent, requests, result)

    async def _create_traced(self, intent: Intent, requests: Sequence[BatchRequest], result: TickResult) -> None:
        try:
            info = await self._provider.create(requests)
        except BatchNotCreated as exc:
            # certainly nothing made: the jobs wait for a later batch
            outcome = "connect_failed" if exc.retryable else "rejected"
            answer = await self._store.refused(
                self._fence, intent.id, outcome=outcome, error_code="llm_unavailable" if exc.retryable else "llm_rejected",
                error_text=storable(f"the batch was refused: {exc.message}"[:500]),
                max_attempts=self.settings.batch_max_attempts)
            result.refused += 1
            result.failed += answer.failed
            result.waiting += answer.waiting
            log.warning("batch.refused", batch=intent.id, retryable=exc.retryable, error=exc.message,
                        failed=answer.failed, waiting=answer.waiting)
            return
        except (BatchCreateUnknown, Exception) as exc:  # noqa: BLE001 - whatever else: a batch may exist
            log.warning("batch.create_unanswered", batch=intent.id, requests=len(requests),
                        error=f"{type(exc).__name__}: {exc}"[:300],
                        detail="reconciled by listing the provider's batches, never created again")
            return
        await self._adopt(intent.id, info, how="created")
        result.submitted += len(requests)

    async def _adopt(self, batch_id: int, info: BatchInfo, *, how: str) -> None:
        answer = await self._store.sent(self._fence, batch_id, info.id, info.expires_at, info.state.value)
        if answer.sent:
            metrics.BATCHES.labels(event=how).inc()
            log.info(f"batch.{how}", batch=batch_id, provider_batch_id=info.id, requests=info.counts.total,
                     expires_at=info.expires_at.isoformat())
        elif answer.known_as is not None:
            # never raised: the intent stays unresolved, for reconciliation
            log.error("batch.already_known", batch=batch_id, provider_batch_id=info.id, known_as=answer.known_as,
                      known_state=answer.known_state, detail="the provider's batch is recorded by another row")
        elif not answer.lease_held:
            log.warning("batch.lease_lost", batch=batch_id, provider_batch_id=info.id,
                        detail="the lease was no longer ours: the next holder reconciles the intent")

    # -- reconciling a lost create answer ------------------------------------------------

    async def _reconcile(self, intents: list[LiveBatch], lost: list[LiveBatch], result: TickResult) -> None:
        fences = [b.fence_at for b in intents] + [b.fence_at for b in lost]
        floor = min(fences) - FENCE_MARGIN
        found: list[BatchInfo] = []
        try:
            async for info in walk(self._provider, stop=lambda b: b.created_at < floor):
                found.append(info)
        except BatchError as exc:
            log.info("batch.list_unavailable", error=exc.message)
            return
        known = await self._store.known([b.id for b in found])
        unknown = sorted((b for b in found if b.id not in known), key=lambda b: b.created_at)
        for intent in intents:
            matching = [b for b in unknown if b.created_at >= intent.fence_at - FENCE_MARGIN
                        and b.counts.total == intent.request_count]
            if matching:
                await self._adopt(intent.id, matching[0], how="adopted")
                unknown.remove(matching[0])
                result.adopted += 1
            elif intent.age_s >= self.settings.batch_reconcile_grace_s:
                answer = await self._store.lost(self._fence, intent.id)
                if not answer.lost:
                    # the lease is no longer ours, or another holder resolved it
                    continue
                result.lost += 1
                result.failed += answer.failed
                metrics.BATCHES.labels(event="lost").inc()
                log.error("batch.lost", batch=intent.id, failed=answer.failed,
                          detail="no batch of it was found: its jobs failed as calls of unknown outcome")
        for stray_of in lost:
            for info in [b for b in unknown if b.created_at >= stray_of.fence_at - FENCE_MARGIN]:
                recorded = await self._store.stray_record(
                    self._fence, info.id, model=stray_of.model, request_count=info.counts.total, created_at=info.created_at,
                    expires_at=info.expires_at, processing_status=info.state.value, lost_batch_id=stray_of.id)
                unknown.remove(info)
                if recorded is not None:
                    result.strays += 1
                    metrics.BATCHES.labels(event="stray").inc()
                    log.warning("batch.stray", batch=recorded, provider_batch_id=info.id, lost_batch=stray_of.id,
                                detail="a batch nobody knew, after a lost create: cancelled, its results charged")

    def _bounds(self, item: BatchItemRow) -> tuple[int, int]:
        """The job's input tokens' bound and its max_tokens."""
        max_tokens = item.max_tokens or self.settings.llm_max_tokens
        try:
            request = msgspec.convert(item.request, StoryRequest)
        except msgspec.ValidationError:
            return 0, max_tokens
        return prompt.input_tokens_at_most(request), max_tokens

    # -- collecting ----------------------------------------------------------------------

    async def _collect(self, batch: LiveBatch, result: TickResult) -> None:
        assert batch.provider_batch_id is not None
        self._seen.polled_at[batch.id] = self._clock()
        try:
            info = await self._provider.retrieve(batch.provider_batch_id)
        except BatchNotFound:
            # the provider no longer knows it. The offline provider after a
            # restart: nothing of it was billed there. A real provider (the
            # batch deleted by someone): its requests may have been billed
            kind = ResultKind.EXPIRED if self._provider.provider == "offline" else ResultKind.UNKNOWN
            await self._ingest_missing(batch, kind, result)
            return
        except BatchError as exc:
            log.info("batch.retrieve_unavailable", batch=batch.id, error=exc.message)
            return
        await self._store.seen(self._fence, batch.id, processing_status=info.state.value,
                               request_counts=msgspec.structs.asdict(info.counts), expires_at=info.expires_at)
        if not info.ended:
            if (batch.abandoned or batch.state == "stray") and batch.cancel_asked_at is None:
                await self._cancel(batch)
            return
        await self._ingest(batch, result)

    async def _cancel(self, batch: LiveBatch) -> None:
        assert batch.provider_batch_id is not None
        try:
            await self._provider.cancel(batch.provider_batch_id)
        except BatchRefused:
            pass  # it ended meanwhile: its results are read at the next look
        except BatchError as exc:
            log.info("batch.cancel_unavailable", batch=batch.id, error=exc.message)
            return
        await self._store.cancel_asked(self._fence, batch.id)
        log.info("batch.cancel_asked", batch=batch.id, provider_batch_id=batch.provider_batch_id,
                 stray=batch.state == "stray")

    def _owner(self, batch: LiveBatch) -> int:
        """The batch whose items a batch's results answer: a stray's are the
        lost intent's it may be."""
        return batch.lost_batch_id if batch.state == "stray" and batch.lost_batch_id else batch.id

    async def _ingest(self, batch: LiveBatch, result: TickResult) -> None:
        assert batch.provider_batch_id is not None
        owner = self._owner(batch)
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
                    await self._ingest_chunk(owner, chunk, result, [every[r.custom_id] for r in chunk])
                    chunk = []
        except (ResultsInterrupted, BatchError) as exc:
            # what was ingested stays; the rest is read again next time
            if chunk:
                await self._ingest_chunk(owner, chunk, result, [every[r.custom_id] for r in chunk])
            log.info("batch.results_interrupted", batch=batch.id, error=exc.message)
            return
        if chunk:
            await self._ingest_chunk(owner, chunk, result, [every[r.custom_id] for r in chunk])
        if batch.state == "stray":
            await self._store.stray_read(self._fence, batch.id)
            return
        # a request the results did not name may have billed: charged as unknown
        if items:
            missing = [self._record(BatchItemResult(custom_id=c, kind=ResultKind.UNKNOWN,
                                                    error_message="its batch ended with no result for it"), item)
                       for c, item in items.items()]
            for start in range(0, len(missing), INGEST_CHUNK):
                part = missing[start:start + INGEST_CHUNK]
                await self._ingest_chunk(owner, part, result, [every[r.custom_id] for r in part])
        if await self._store.results_read(self._fence, batch.id):
            metrics.BATCHES.labels(event="read").inc()
            log.info("batch.results_read", batch=batch.id, provider_batch_id=batch.provider_batch_id)

    async def _ingest_missing(self, batch: LiveBatch, kind: ResultKind, result: TickResult) -> None:
        owner = self._owner(batch)
        if batch.state == "stray":
            await self._store.stray_read(self._fence, batch.id)
            return
        items = await self._store.items_of(owner)
        records = [self._record(BatchItemResult(custom_id=item.custom_id, kind=kind,
                                                error_message="the provider no longer knows its batch"), item)
                   for item in items]
        for start in range(0, len(records), INGEST_CHUNK):
            await self._ingest_chunk(owner, records[start:start + INGEST_CHUNK], result,
                                     items[start:start + INGEST_CHUNK])
        await self._store.results_read(self._fence, batch.id)
        log.warning("batch.not_found", batch=batch.id, provider_batch_id=batch.provider_batch_id,
                    requests=len(records), detail=f"its unread requests were read as {kind.value}")

    def _record(self, item_result: BatchItemResult, item: BatchItemRow) -> ResultRecord:
        at_most, max_tokens = self._bounds(item)
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

    async def _ingest_chunk(self, owner: int, chunk: list[ResultRecord], result: TickResult,
                            items: Sequence[BatchItemRow] = ()) -> None:
        with self._tracer.start_as_current_span("storyjobs.batch.ingest", links=_links(i.trace_context for i in items),
                                                attributes={"storyjobs.batch.id": owner,
                                                            "storyjobs.batch.results": len(chunk)}):
            answer = await self._store.ingest(self._fence, owner, chunk, max_attempts=self.settings.batch_max_attempts,
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



def _links(carriers: Iterable[object]) -> list[Link]:
    """Links to the jobs' traces, as many as a span keeps."""
    found = (telemetry.link_from_carrier(carrier) for carrier in carriers)
    return list(itertools.islice((link for link in found if link is not None), _LINKS_MAX))
