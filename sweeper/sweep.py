"""The sweeper's pass: ``Sweeper.sweep_once() -> SweepResult``.

Rules, each one guarded statement (job_fail_stale) over the active index:
a running job whose heartbeat is older than HEARTBEAT_TIMEOUT_S fails as
``interrupted`` (its worker died); one running longer than JOB_TIMEOUT_S as
``timed_out``; one pending longer than PENDING_TIMEOUT_S as ``queue_timeout``.

No false deaths: while workers cannot write (the database unreachable or
restarted, turned read-only, or a lock on story_jobs held by a careless
migration), their heartbeats stop and their finished stories cannot be
settled, yet they are alive. So the two rules about running jobs (heartbeat
and job timeout) are applied only once the sweeper has seen the database
writable for a whole HEARTBEAT_TIMEOUT_S: every pass and every probe between
passes (at the heartbeat interval) takes the lock a heartbeat takes, under a
lock timeout of one heartbeat interval, and fails as a heartbeat would on a
read-only database. Any failure starts that wait again.

Traces (when shared/telemetry.py turns them on): a pass is a span,
``storyjobs.sweep``, with its counts as attributes; in it, a span per batch
of the rules (``storyjobs.sweep.fail_stale``) and per prune batch
(``storyjobs.sweep.prune``), and a span per job failed
(``storyjobs.sweep.job_failed``: its id, reason and worker) linked to the
job's own trace, whose context the job carries. A pruned job's trace is
linked from its prune batch's span. Attributes hold ids, reasons and counts
only, never a prompt or a story.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime

import msgspec
import structlog
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from shared import telemetry
from shared.config import SweeperSettings
from shared.rows import SnapshotAges
from shared.status import ErrorCode, JobStatus
from sweeper import metrics
from sweeper.rows import PrunedJob, StaleJob
from sweeper.store import SweeperStore

log = structlog.get_logger()

# at most this many prune batches per pass, so one pass stays short
PRUNE_BATCHES_PER_PASS = 10


class SweepResult(msgspec.Struct, frozen=True):
    interrupted: int
    timed_out: int
    queue_timeout: int
    pruned: int
    # ledger rows deleted past LEDGER_RETENTION_S
    ledger_pruned: int
    pending: int
    running: int
    oldest_pending_age_seconds: float
    # whether the rules about running jobs were applied (see the module's doc)
    judged_running: bool

    @property
    def reclaimed(self) -> int:
        return self.interrupted + self.timed_out + self.queue_timeout


class Sweeper:
    def __init__(
        self,
        settings: SweeperSettings,
        store: SweeperStore,
        *,
        clock: Callable[[], float] = time.monotonic,
        tracer: Tracer | None = None,
    ) -> None:
        self.settings = settings
        self._store = store
        self._clock = clock
        # the global provider's (a no-op one while tracing is off); tests pass their own
        self._tracer = tracer or trace.get_tracer(__name__)
        self._writable_since: float | None = None
        self._server_started_at: datetime | None = None
        # the floor's advances in a row that did not get the admission lock
        self._floor_lock_misses = 0

    def connection_lost(self) -> None:
        """Call when a database operation failed: running jobs cannot be
        judged until the database has been writable for a heartbeat timeout."""
        self._writable_since = None
        metrics.HEARTBEAT_CHECKS.set(0)

    async def probe(self) -> None:
        """A cheap check between passes that a heartbeat could be written now,
        so that an outage, a read-only spell or a long lock shorter than
        SWEEPER_INTERVAL_S is noticed too. Raises when it could not."""
        self._writable(await self._store.probe(lock_timeout_s=self._lock_timeout_s))

    async def advance_claim_floor(self) -> None:
        """Raises the claim's floor (migration 030) to the smallest pending
        turn, under the admission lock, waiting for it no longer than for
        any other lock. Every pass does it, and the loop between passes.

        A lock not had in time (a bulk cancel holding the admission lock) is
        no outage: it says nothing of whether a heartbeat can be written, so
        running jobs go on being judged, and the floor rises next time."""
        if await self._store.advance_claim_floor(lock_timeout_s=self._lock_timeout_s) is None:
            # once for a run of misses, as an outage is logged once
            if self._floor_lock_misses == 0:
                log.warning("sweeper.claim_floor_lock_waited", lock_timeout_s=self._lock_timeout_s,
                            detail="the claim's floor rises once the admission lock is had")
            self._floor_lock_misses += 1
        elif self._floor_lock_misses:
            log.info("sweeper.claim_floor_advanced", after_misses=self._floor_lock_misses)
            self._floor_lock_misses = 0

    @property
    def _lock_timeout_s(self) -> float:
        return self.settings.heartbeat_interval_s

    def _writable(self, server_started_at: datetime) -> None:
        if self._server_started_at is not None and server_started_at != self._server_started_at:
            log.warning("sweeper.server_restarted", detail="running jobs not judged for a heartbeat timeout")
            self._writable_since = None
        self._server_started_at = server_started_at
        if self._writable_since is None:
            self._writable_since = self._clock()

    def running_jobs_judgeable(self) -> bool:
        return (
            self._writable_since is not None
            and self._clock() - self._writable_since >= self.settings.heartbeat_timeout_s
        )

    async def sweep_once(self, *, now: datetime | None = None) -> SweepResult:
        """One pass, as one span (storyjobs.sweep) with its counts. ``now``
        replaces the database's clock (tests)."""
        with self._tracer.start_as_current_span("storyjobs.sweep", record_exception=False,
                                                set_status_on_exception=False) as span:
            try:
                result = await self._sweep(now)
            except Exception as exc:
                _failed(span, exc)
                raise
            span.set_attributes({
                "storyjobs.sweep.failed": result.reclaimed,
                "storyjobs.sweep.failed.interrupted": result.interrupted,
                "storyjobs.sweep.failed.timed_out": result.timed_out,
                "storyjobs.sweep.failed.queue_timeout": result.queue_timeout,
                "storyjobs.sweep.pruned": result.pruned,
                "storyjobs.sweep.ledger_pruned": result.ledger_pruned,
                "storyjobs.sweep.judged_running": result.judged_running,
                "storyjobs.jobs.pending": result.pending,
                "storyjobs.jobs.running": result.running,
            })
            return result

    async def _sweep(self, now: datetime | None) -> SweepResult:
        counts = dict.fromkeys(metrics.REASONS, 0)
        self._writable(await self._store.probe(lock_timeout_s=self._lock_timeout_s))
        judge_running = self.running_jobs_judgeable()
        metrics.HEARTBEAT_CHECKS.set(1 if judge_running else 0)
        while True:
            stale = await self._fail_stale(judge_running, now)
            for job in stale:
                counts[job.reason] += 1
            if len(stale) < self.settings.sweeper_batch_size:
                break
        # after the rules, which may have failed the jobs it would stop at
        await self.advance_claim_floor()
        gauges = await self._store.queue_gauges(now=now)
        await self._store.record_minutes(self.settings, pending=gauges.pending, running=gauges.running)
        budgets = await self._store.budget_days_today(now=now)
        outbox = await self._store.webhook_delivery_gauges(now=now)
        over_reservation = await self._store.budget_over_reservation_total()
        snapshots = await self._store.snapshot_ages()
        pruned = await self.prune_finished(now)
        ledger_pruned = await self.prune_ledger(now)
        kept = await self._store.keep_story_partitions(retention_s=self.settings.job_retention_s, now=now)
        metrics.STORY_PARTITIONS_DROPPED.inc(kept.dropped)
        metrics.STORY_PARTITIONS_BEHIND.set(1 if kept.behind else 0)
        metrics.JOBS.labels(status=JobStatus.PENDING).set(gauges.pending)
        metrics.JOBS.labels(status=JobStatus.RUNNING).set(gauges.running)
        metrics.OLDEST_PENDING_AGE.set(gauges.oldest_pending_age_seconds)
        for day in budgets:
            metrics.BUDGET_SPENT.labels(scope=day.scope).set(float(day.spent_usd))
            metrics.BUDGET_RESERVED.labels(scope=day.scope).set(float(day.reserved_usd))
        metrics.WEBHOOK_UNDELIVERED.set(outbox.undelivered)
        metrics.WEBHOOK_OLDEST_UNDELIVERED_AGE.set(outbox.oldest_undelivered_age_seconds)
        metrics.OVER_RESERVATION.value = float(over_reservation)
        _export_snapshot_ages(snapshots)
        metrics.LAST_RUN.set_to_current_time()
        result = SweepResult(
            interrupted=counts[ErrorCode.INTERRUPTED],
            timed_out=counts[ErrorCode.TIMED_OUT],
            queue_timeout=counts[ErrorCode.QUEUE_TIMEOUT],
            pruned=pruned,
            ledger_pruned=ledger_pruned,
            pending=gauges.pending,
            running=gauges.running,
            oldest_pending_age_seconds=gauges.oldest_pending_age_seconds,
            judged_running=judge_running,
        )
        if result.reclaimed or pruned or ledger_pruned:
            log.info("sweeper.pass", reclaimed=result.reclaimed, interrupted=result.interrupted,
                     timed_out=result.timed_out, queue_timeout=result.queue_timeout, pruned=pruned,
                     ledger_pruned=ledger_pruned)
        return result

    async def _fail_stale(self, judge_running: bool, now: datetime | None) -> list[StaleJob]:
        """One batch of the rules, as a span (storyjobs.sweep.fail_stale) with
        its counts; each job failed gets a span of its own, linked to the
        job's trace when it carries one."""
        with self._tracer.start_as_current_span("storyjobs.sweep.fail_stale", record_exception=False,
                                                set_status_on_exception=False) as span:
            try:
                stale = await self._store.fail_stale(
                    heartbeat_timeout_s=self.settings.heartbeat_timeout_s,
                    job_timeout_s=self.settings.job_timeout_s,
                    pending_timeout_s=self.settings.pending_timeout_s,
                    judge_running=judge_running,
                    batch_size=self.settings.sweeper_batch_size,
                    lock_timeout_s=self._lock_timeout_s,
                    now=now,
                    batch_collect_s=self.settings.batch_collect_s,
                )
            except Exception as exc:
                _failed(span, exc)
                raise
            by_reason = Counter(job.reason for job in stale)
            span.set_attributes({
                "storyjobs.sweep.failed": len(stale),
                **{f"storyjobs.sweep.failed.{reason.value}": by_reason[reason] for reason in metrics.REASONS},
            })
            for job in stale:
                self._job_failed(job)
        return stale

    def _job_failed(self, job: StaleJob) -> None:
        """What the sweeper did to one job: a metric, a log line, and a span
        in the pass's trace linked to the job's own."""
        link = telemetry.link_from_carrier(job.trace_context)
        with self._tracer.start_as_current_span(
            "storyjobs.sweep.job_failed",
            links=[link] if link is not None else None,
            attributes={
                "storyjobs.job.id": str(job.public_id),
                "storyjobs.job.error_code": job.reason.value,
                **({"storyjobs.worker.id": job.worker_id} if job.worker_id is not None else {}),
            },
        ):
            metrics.RECLAIMED.labels(reason=job.reason).inc()
            log.warning("sweeper.reclaimed", job_id=str(job.public_id), reason=job.reason,
                        worker_id=job.worker_id)

    async def prune_finished(self, now: datetime | None = None) -> int:
        """A pass's prune of finished jobs past JOB_RETENTION_S: up to
        PRUNE_BATCHES_PER_PASS batches, until one deletes nothing; how many."""
        # the walk's end, read once for the pass's batches: a job that expires
        # above it during the pass is the next pass's
        below_id = await self._store.prune_below_id(retention_s=self.settings.job_retention_s, now=now)
        pruned, after_id = 0, 0
        for _ in range(PRUNE_BATCHES_PER_PASS):
            jobs = await self._prune(now, below_id, after_id)
            pruned += len(jobs)
            if not jobs:
                break
            # the next batch walks on from here: each job below was judged
            after_id = max(job.id for job in jobs)
        metrics.PRUNED.inc(pruned)
        return pruned

    async def _prune(self, now: datetime | None, below_id: int, after_id: int) -> list[PrunedJob]:
        """One prune batch, as a span (storyjobs.sweep.prune) with its count
        and a link to each pruned job's trace (up to the SDK's link limit,
        OTEL_SPAN_LINK_COUNT_LIMIT, 128 by default; the rest are counted as
        dropped)."""
        with self._tracer.start_as_current_span("storyjobs.sweep.prune", record_exception=False,
                                                set_status_on_exception=False) as span:
            try:
                jobs = await self._store.prune_finished(
                    retention_s=self.settings.job_retention_s, batch_size=self.settings.sweeper_batch_size,
                    now=now, below_id=below_id, after_id=after_id,
                )
            except Exception as exc:
                _failed(span, exc)
                raise
            span.set_attribute("storyjobs.sweep.pruned", len(jobs))
            if span.is_recording():
                for job in jobs:
                    if (link := telemetry.link_from_carrier(job.trace_context)) is not None:
                        span.add_link(link.context)
        return jobs

    async def prune_ledger(self, now: datetime | None = None) -> int:
        """A pass's share of the ledger's own retention: up to
        PRUNE_BATCHES_PER_PASS batches, until one comes short, none when
        LEDGER_RETENTION_S is unset (the ledger kept); how many rows."""
        retention_s = self.settings.ledger_retention_s
        deleted = 0
        if retention_s is None:
            return deleted
        after: datetime | None = None
        for _ in range(PRUNE_BATCHES_PER_PASS):
            batch = await self._store.prune_ledger(retention_s=retention_s,
                                                   batch_size=self.settings.sweeper_batch_size, now=now, after=after)
            deleted += batch.deleted
            if batch.deleted < self.settings.sweeper_batch_size:
                break
            # the next batch walks on from here: each row before was judged
            after = batch.last_started_at
        metrics.LEDGER_PRUNED.inc(deleted)
        return deleted


def _failed(span: Span, exc: Exception) -> None:
    # the error's type only: a message could quote a row
    span.set_status(Status(StatusCode.ERROR))
    span.set_attribute("error.type", type(exc).__qualname__)


def _export_snapshot_ages(ages: SnapshotAges) -> None:
    """The gauges of what holds VACUUM back; NaN where the role cannot see."""
    unknown = float("nan")
    metrics.SNAPSHOT_AGES_KNOWN.set(1 if ages.known else 0)
    metrics.OLDEST_TRANSACTION_AGE.set(
        (ages.oldest_transaction_age_s or 0.0) if ages.known else unknown)
    metrics.OLDEST_SNAPSHOT_AGE.set((ages.oldest_snapshot_age_s or 0.0) if ages.known else unknown)
    metrics.REPLICATION_SLOT_XMIN_AGE.set(ages.replication_slot_xmin_age or 0)
