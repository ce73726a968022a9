"""The batch lane: a story within the day at half the price, billed once
whatever is lost (docs/batches.md).

This module owns the loop, the submitter's lease and the order of a tick;
each step of a tick is its own part's. ``BatchLane.run()`` repeats
``tick_once()`` until stopped. A tick does nothing unless this worker holds
the submitter's lease (batch_leases: one holder at a time in the whole
system, passed on when it runs out). The holder, in one tick:

1. reconciles the intents whose create call was not answered, and records
   the strays of the lost ones (worker/batch/reconciler.py). A create is
   never sent again blindly;
2. collects the batches in flight every BATCH_POLL_INTERVAL_S: what the
   provider says of each, a cancel for one whose jobs all ended elsewhere,
   and for an ended one its results (worker/batch/collector.py);
3. submits when BATCH_MAX_REQUESTS jobs wait or the oldest has waited
   BATCH_COLLECT_S, and no intent is unresolved (worker/batch/submitter.py).

Every write of the holder is fenced by the lease this tick took (``Lease``):
it changes nothing once the lease is no longer ours.

Crash-only: killed at any line, the lease runs out and the next holder
finds in the database everything it needs (an unresolved intent is
reconciled, a batch in flight collected). Database errors are logged once
per episode and waited out with the worker's backoff; a provider that does
not answer is asked again at the next tick.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import structlog
from opentelemetry import trace
from opentelemetry.trace import Tracer

from shared import db
from shared.config import WorkerSettings
from worker.backoff import Backoff
from worker.batch import metrics
from worker.batch.collector import Collector
from worker.batch.provider import BatchProvider
from worker.batch.reconciler import Reconciler
from worker.batch.rows import Lease, LeaseTaken
from worker.batch.store import BatchStore
from worker.batch.submitter import Submitter
from worker.batch.tick import TickResult

log = structlog.get_logger()

# the lease outlasts a create call by this much, so that a holder never sends
# under a lease that can run out before the call ends
LEASE_MARGIN_S = 30.0
# how often a worker that does not hold the lease asks for it
_STANDBY_S = 30.0


class BatchLane:
    """The lane's loop on one worker: takes the lease, then runs the parts in order."""

    def __init__(self, settings: WorkerSettings, store: BatchStore, provider: BatchProvider, *,
                 holder: str | None = None, clock: Callable[[], float] = time.monotonic,
                 tracer: Tracer | None = None) -> None:
        self.settings = settings
        # traces on: the create and each ingestion a span, linked to the jobs' traces
        self._tracer = tracer or trace.get_tracer("storyjobs.worker.batch")
        self._store = store
        self._provider = provider
        self.holder = holder or f"lane-{uuid.uuid4().hex[:12]}"
        self._lease: LeaseTaken | None = None
        self._stopping = asyncio.Event()
        self._errors = db.ErrorEpisode("batch", clock=clock, task="lane")
        self._backoff = Backoff()
        self._reconciler = Reconciler(settings, store, provider)
        self._collector = Collector(settings, store, provider, self._tracer, clock)
        self._submitter = Submitter(settings, store, provider, self._tracer)

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
            fence = self._fence
            if intents or lost:
                await self._reconciler.reconcile(fence, intents, lost, result)
            for batch in live:
                if batch.state in ("sent", "stray") and self._collector.poll_due(batch):
                    await self._collector.collect(fence, batch, result)
            if not intents:
                await self._submitter.submit_if_due(fence, self.lease_s, result)
        except db.DB_ERRORS as exc:
            self._errors.failed(exc, holder=self.holder)
            result.database_error = db.describe(exc)
            return result
        self._errors.succeeded()
        self._backoff.reset()
        return result
