"""The sweeper's pass: ``Sweeper.sweep_once() -> SweepResult``.

Rules, each one guarded statement (job_fail_stale) over the active index:
a running job whose heartbeat is older than HEARTBEAT_TIMEOUT_S fails as
``interrupted`` (its worker died); one running longer than JOB_TIMEOUT_S as
``timed_out``; one pending longer than PENDING_TIMEOUT_S as ``queue_timeout``.

No false deaths after an outage: while the database was unreachable, live
workers could not write heartbeats either. The heartbeat rule is therefore
applied only once the sweeper itself has been connected without a break for
a whole HEARTBEAT_TIMEOUT_S; its connection breaking, or the server having
restarted, starts that wait again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime

import msgspec
import psycopg
import structlog
from psycopg_pool import AsyncConnectionPool

from shared import store
from shared.config import SweeperSettings
from sweeper import metrics

log = structlog.get_logger()

DB_ERRORS = (psycopg.OperationalError, psycopg.InterfaceError)
# at most this many prune batches per pass, so one pass stays short
_PRUNE_BATCHES_PER_PASS = 10


class SweepResult(msgspec.Struct, frozen=True):
    interrupted: int
    timed_out: int
    queue_timeout: int
    pruned: int
    pending: int
    running: int
    oldest_pending_age_seconds: float
    checked_heartbeats: bool

    @property
    def reclaimed(self) -> int:
        return self.interrupted + self.timed_out + self.queue_timeout


class Sweeper:
    def __init__(
        self,
        settings: SweeperSettings,
        pool: AsyncConnectionPool,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._pool = pool
        self._clock = clock
        self._healthy_since: float | None = None
        self._server_started_at: datetime | None = None

    def connection_lost(self) -> None:
        """Call when a database operation failed: heartbeats cannot be judged
        until the connection has been healthy for a heartbeat timeout."""
        if self._healthy_since is not None:
            log.warning("sweeper.database_unavailable",
                        detail="heartbeat checks paused until the connection is healthy again")
        self._healthy_since = None
        metrics.HEARTBEAT_CHECKS.set(0)

    async def probe(self) -> None:
        """A cheap round trip between passes, so that an outage shorter than
        SWEEPER_INTERVAL_S is noticed too."""
        async with self._pool.connection() as conn:
            started_at = await store.server_started_at(conn)
        self._connected(started_at)

    def _connected(self, server_started_at: datetime) -> None:
        if self._server_started_at is not None and server_started_at != self._server_started_at:
            log.warning("sweeper.server_restarted", detail="heartbeat checks paused for a heartbeat timeout")
            self._healthy_since = None
        self._server_started_at = server_started_at
        if self._healthy_since is None:
            self._healthy_since = self._clock()

    def heartbeats_trustworthy(self) -> bool:
        return (
            self._healthy_since is not None
            and self._clock() - self._healthy_since >= self.settings.heartbeat_timeout_s
        )

    async def sweep_once(self, *, now: datetime | None = None) -> SweepResult:
        """One pass. ``now`` replaces the database's clock (tests)."""
        counts = {reason.value: 0 for reason in metrics.REASONS}
        pruned = 0
        async with self._pool.connection() as conn:
            self._connected(await store.server_started_at(conn))
            check_heartbeats = self.heartbeats_trustworthy()
            metrics.HEARTBEAT_CHECKS.set(1 if check_heartbeats else 0)
            while True:
                stale = await store.job_fail_stale(
                    conn,
                    heartbeat_timeout_s=self.settings.heartbeat_timeout_s,
                    job_timeout_s=self.settings.job_timeout_s,
                    pending_timeout_s=self.settings.pending_timeout_s,
                    check_heartbeats=check_heartbeats,
                    batch_size=self.settings.sweeper_batch_size,
                    now=now,
                )
                for job in stale:
                    counts[job.reason] += 1
                    metrics.RECLAIMED.labels(reason=job.reason).inc()
                    log.warning("sweeper.reclaimed", job_id=str(job.public_id), reason=job.reason,
                                worker_id=job.worker_id)
                if len(stale) < self.settings.sweeper_batch_size:
                    break
            gauges = await store.job_queue_gauges(conn, now=now)
            for _ in range(_PRUNE_BATCHES_PER_PASS):
                deleted = await store.job_prune_finished(
                    conn, retention_s=self.settings.job_retention_s,
                    batch_size=self.settings.sweeper_batch_size, now=now,
                )
                pruned += deleted
                if deleted == 0:
                    break
        metrics.PRUNED.inc(pruned)
        metrics.JOBS.labels(status="pending").set(gauges.pending)
        metrics.JOBS.labels(status="running").set(gauges.running)
        metrics.OLDEST_PENDING_AGE.set(gauges.oldest_pending_age_seconds)
        metrics.LAST_RUN.set_to_current_time()
        result = SweepResult(
            interrupted=counts["interrupted"],
            timed_out=counts["timed_out"],
            queue_timeout=counts["queue_timeout"],
            pruned=pruned,
            pending=gauges.pending,
            running=gauges.running,
            oldest_pending_age_seconds=gauges.oldest_pending_age_seconds,
            checked_heartbeats=check_heartbeats,
        )
        if result.reclaimed or pruned:
            log.info("sweeper.pass", reclaimed=result.reclaimed, interrupted=result.interrupted,
                     timed_out=result.timed_out, queue_timeout=result.queue_timeout, pruned=pruned)
        return result
