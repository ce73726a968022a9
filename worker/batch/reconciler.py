"""Reconciling: what the provider's list says against our rows, after a
create whose answer was lost (docs/batches.md).

An intent whose create was not answered is resolved by walking the
provider's list newest first down to the intent's fence (less a clock
margin) and adopting the one batch we do not know whose request count is
the intent's; none within BATCH_RECONCILE_GRACE_S, the intent is lost and
its jobs fail as calls of unknown outcome, charged their worst case. For a
day after an intent is lost, any batch of the workspace we do not know is
recorded as a stray: cancelled, and its results charged by custom_id
(batch_live_list lists the intents lost in the last 24 hours: a create is
answered, at the latest, well within a day). A create is never sent again
blindly.
"""

from __future__ import annotations

from datetime import timedelta

import structlog

from shared.config import WorkerSettings
from worker.batch import metrics
from worker.batch.provider import BatchError, BatchProvider, walk
from worker.batch.provider_structs import BatchInfo
from worker.batch.rows import Lease, LiveBatch
from worker.batch.store import BatchStore
from worker.batch.submitter import adopt
from worker.batch.tick import TickResult

log = structlog.get_logger()

# clocks differ: the provider's created_at of a batch made just after our
# fence may read up to this much earlier
FENCE_MARGIN = timedelta(minutes=5)


class Reconciler:
    """Resolves the unresolved intents and records the strays, for the lease's holder."""

    def __init__(self, settings: WorkerSettings, store: BatchStore, provider: BatchProvider) -> None:
        self.settings = settings
        self._store = store
        self._provider = provider

    async def reconcile(self, fence: Lease, intents: list[LiveBatch], lost: list[LiveBatch],
                        result: TickResult) -> None:
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
        await self._resolve(fence, intents, unknown, result)
        await self._record_strays(fence, lost, unknown, result)

    async def _resolve(self, fence: Lease, intents: list[LiveBatch], unknown: list[BatchInfo],
                       result: TickResult) -> None:
        """Each intent adopts the first unknown batch of its size made after
        its fence, taken out of ``unknown``; none past the grace, it is lost."""
        for intent in intents:
            matching = [b for b in unknown if b.created_at >= intent.fence_at - FENCE_MARGIN
                        and b.counts.total == intent.request_count]
            if matching:
                await adopt(self._store, fence, intent.id, matching[0], how="adopted")
                unknown.remove(matching[0])
                result.adopted += 1
            elif intent.age_s >= self.settings.batch_reconcile_grace_s:
                answer = await self._store.lost(fence, intent.id)
                if not answer.lost:
                    # the lease is no longer ours, or another holder resolved it
                    continue
                result.lost += 1
                result.failed += answer.failed
                metrics.BATCHES.labels(event="lost").inc()
                log.error("batch.lost", batch=intent.id, failed=answer.failed,
                          detail="no batch of it was found: its jobs failed as calls of unknown outcome")

    async def _record_strays(self, fence: Lease, lost: list[LiveBatch], unknown: list[BatchInfo],
                             result: TickResult) -> None:
        """Every unknown batch made after a lost intent's fence is a stray of it."""
        for stray_of in lost:
            for info in [b for b in unknown if b.created_at >= stray_of.fence_at - FENCE_MARGIN]:
                recorded = await self._store.stray_record(
                    fence, info.id, model=stray_of.model, request_count=info.counts.total, created_at=info.created_at,
                    expires_at=info.expires_at, processing_status=info.state.value, lost_batch_id=stray_of.id)
                unknown.remove(info)
                if recorded is not None:
                    result.strays += 1
                    metrics.BATCHES.labels(event="stray").inc()
                    log.warning("batch.stray", batch=recorded, provider_batch_id=info.id, lost_batch=stray_of.id,
                                detail="a batch nobody knew, after a lost create: cancelled, its results charged")
