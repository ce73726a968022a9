"""Submitting: the jobs waiting for a batch made into an intent, and the
intent into one provider batch (docs/batches.md).

When BATCH_MAX_REQUESTS jobs wait or the oldest has waited BATCH_COLLECT_S,
the intent (jobs moved into it, items, ledger rows) is committed under the
renewed lease, then one create call is sent, with no retry. Only a create
the provider certainly refused puts the jobs back; any other failure leaves
the intent unresolved, for the reconciler: a create is never sent again
blindly. ``adopt`` records a provider batch as an intent's, for a create
answered here and for one the reconciler finds by listing.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import structlog
from opentelemetry.trace import Tracer

from shared.config import WorkerSettings
from shared.text import storable
from worker.batch import metrics
from worker.batch.provider import BatchCreateUnknown, BatchNotCreated, BatchProvider
from worker.batch.provider_structs import BatchInfo, BatchRequest
from worker.batch.rows import Intent, Lease
from worker.batch.store import BatchStore
from worker.batch.tick import TickResult, links

log = structlog.get_logger()


class Submitter:
    """Sends the waiting jobs as one batch, for the lease's holder."""

    def __init__(self, settings: WorkerSettings, store: BatchStore, provider: BatchProvider, tracer: Tracer) -> None:
        self.settings = settings
        self._store = store
        self._provider = provider
        self._tracer = tracer

    async def submit_if_due(self, fence: Lease, lease_s: float, result: TickResult) -> None:
        summary = await self._store.ready_summary(self.settings.batch_max_requests)
        due = summary.ready >= self.settings.batch_max_requests or (
            summary.ready > 0 and summary.oldest_s >= self.settings.batch_collect_s)
        if not due:
            return
        intent = await self._store.intent_create(
            fence, lease_s, max_requests=self.settings.batch_max_requests,
            model=self.settings.llm_model, provider=self._provider.provider)
        if intent is None:
            return
        requests = await self._requests(fence, intent)
        if not requests:
            # every request of it was dropped: nothing to send, nothing to reconcile
            await self._store.refused(fence, intent.id, outcome="not_sent", error_code="invalid_request",
                                      error_text="no request of the batch could be sent",
                                      max_attempts=self.settings.batch_max_attempts)
            return
        # the lease renewed just before the call: a holder whose lease ran
        # out never sends (another may be reconciling this very intent)
        renewed = await self._store.lease_take(fence.holder, lease_s)
        if renewed is None or renewed.token != fence.token:
            log.warning("batch.lease_lost_before_create", batch=intent.id)
            # the intent, never sent, closed by the holder that made it,
            # whoever holds the lease now (sql/batch.sql, batch_refused)
            answer = await self._store.refused(fence, intent.id, outcome="not_sent",
                                               error_code="llm_unavailable",
                                               error_text="the lane lost its lease before the batch was sent",
                                               max_attempts=self.settings.batch_max_attempts + len(requests))
            result.waiting += answer.waiting
            return
        await self._create(fence, intent, requests, result)

    async def _requests(self, fence: Lease, intent: Intent) -> list[BatchRequest]:
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
            await self._store.items_drop(fence, intent.id, invalid, "the stored request is not valid")
        return requests

    async def _create(self, fence: Lease, intent: Intent, requests: Sequence[BatchRequest],
                      result: TickResult) -> None:
        with self._tracer.start_as_current_span("storyjobs.batch.create", links=links(
                item.trace_context for item in intent.items), attributes={
                "storyjobs.batch.id": intent.id, "storyjobs.batch.requests": len(requests)}):
            await self._create_traced(fence, intent, requests, result)

    async def _create_traced(self, fence: Lease, intent: Intent, requests: Sequence[BatchRequest],
                             result: TickResult) -> None:
        try:
            info = await self._provider.create(requests)
        except BatchNotCreated as exc:
            # certainly nothing made: the jobs wait for a later batch
            outcome = "connect_failed" if exc.retryable else "rejected"
            answer = await self._store.refused(
                fence, intent.id, outcome=outcome, error_code="llm_unavailable" if exc.retryable else "llm_rejected",
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
        await adopt(self._store, fence, intent.id, info, how="created")
        result.submitted += len(requests)


async def adopt(store: BatchStore, fence: Lease, batch_id: int, info: BatchInfo, *, how: str) -> None:
    """The intent ``batch_id`` recorded as the provider's batch ``info``
    (``how``: created, or adopted by the reconciler). A batch another row
    already records, or a lease no longer ours, leaves the intent
    unresolved, for reconciliation: logged, never raised."""
    answer = await store.sent(fence, batch_id, info.id, info.expires_at, info.state.value)
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
