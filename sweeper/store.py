"""What the sweeper asks of the database, as one typed interface.

``SweeperStore`` is everything a pass and a probe need (sweeper/sweep.py);
``PgSweeperStore`` does it with a connection pool and the sweeper's named
queries (sql/sweeper.sql), each run by one small typed function below. A
recording fake of the same interface (tests/fakes/recording_sweeper_store.py)
lets the sweeper's rules be tested without a database. Every method may
raise any of ``shared.db.DB_ERRORS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Protocol

from psycopg_pool import AsyncConnectionPool

from shared.config import SweeperSettings
from shared.queries import QUERIES as Q
from shared.rows import ROLLUP_BOUNDS_S, BudgetDay, SnapshotAges
from shared.store import (
    Conn,
    budget_days_today,
    database_snapshot_ages,
    fetch_all,
    fetch_one,
    fetch_scalars,
    job_id_bounds,
)
from sweeper import rollup
from sweeper.rows import PrunedJob, QueueGauges, StaleJob, WebhookDeliveryGauges

# -- stale jobs ----------------------------------------------------------------------


async def job_fail_stale(
    conn: Conn,
    *,
    heartbeat_timeout_s: float,
    job_timeout_s: float,
    pending_timeout_s: float,
    judge_running: bool,
    batch_size: int,
    lock_timeout_s: float,
    now: datetime | None = None,
    batch_collect_s: float = 60.0,
) -> list[StaleJob]:
    """One batch of the sweeper's rules (the ledger rows its jobs left open
    closed by the same statement), in one transaction whose statements wait
    at most lock_timeout_s for a lock."""
    async with conn.transaction():
        await _set_lock_timeout(conn, lock_timeout_s)
        swept = await fetch_all(
            conn,
            StaleJob,
            "job_fail_stale",
            {
                "heartbeat_timeout_s": heartbeat_timeout_s,
                "job_timeout_s": job_timeout_s,
                "pending_timeout_s": pending_timeout_s,
                "judge_running": judge_running,
                "batch_size": batch_size,
                "batch_collect_s": batch_collect_s,
                "now": now,
            },
        )
    return swept


async def _set_lock_timeout(conn: Conn, lock_timeout_s: float) -> None:
    await conn.execute(Q["transaction_lock_timeout_set"], {"lock_timeout_ms": max(1, round(lock_timeout_s * 1000))})


async def sweeper_probe(conn: Conn, *, lock_timeout_s: float) -> datetime:
    """Raises unless a heartbeat could be written right now (within
    lock_timeout_s); returns the server's start time."""
    async with conn.pipeline(), conn.transaction():
        await _set_lock_timeout(conn, lock_timeout_s)
        cur = await conn.execute(Q["sweeper_probe"])
    row = await cur.fetchone()
    assert row is not None
    started_at: datetime = row[0]
    return started_at


# -- gauges and pruning --------------------------------------------------------------


async def job_queue_gauges(conn: Conn, *, now: datetime | None = None) -> QueueGauges:
    row = await fetch_one(conn, QueueGauges, "job_queue_gauges", {"now": now})
    assert row is not None
    return row


async def job_prune_finished_jobs(
    conn: Conn, *, retention_s: float, batch_size: int, now: datetime | None = None
) -> list[PrunedJob]:
    """Deletes one batch of jobs finished longer ago than retention_s; the
    jobs deleted, each with its trace context. The walk's end is found by
    this process's clock, with job_id_bounds' margin: the statement judges
    each job by the database's."""
    cutoff = (now or datetime.now(UTC)) - timedelta(seconds=retention_s)
    bounds = await job_id_bounds(conn, created_after=None, created_before=cutoff)
    return await fetch_all(conn, PrunedJob, "job_prune_finished", {
        "retention_s": retention_s, "batch_size": batch_size, "now": now, "below_id": bounds.hi_id})


async def job_prune_finished(
    conn: Conn, *, retention_s: float, batch_size: int, now: datetime | None = None
) -> int:
    """job_prune_finished_jobs, counted."""
    return len(await job_prune_finished_jobs(conn, retention_s=retention_s, batch_size=batch_size, now=now))


async def budget_over_reservation_total(conn: Conn) -> Decimal:
    (total,) = await fetch_scalars(conn, "budget_over_reservation_total")
    return Decimal(total)


async def webhook_delivery_gauges(conn: Conn, *, now: datetime | None = None) -> WebhookDeliveryGauges:
    row = await fetch_one(conn, WebhookDeliveryGauges, "webhook_delivery_gauges", {"now": now})
    assert row is not None
    return row


# -- the console's history -----------------------------------------------------------


async def rollup_minutes(conn: Conn, *, from_minute: datetime, from_id: int, ending_from_id: int,
                         bounds_s: Sequence[float], pending: int, running: int) -> int:
    """Recounts minute_rollup from from_minute to now; the minutes written.
    ``ending_from_id`` is at or below every job that can end after now."""
    found = await fetch_scalars(conn, "rollup_minutes", {
        "from_minute": from_minute, "from_id": from_id, "ending_from_id": ending_from_id,
        "bounds_s": [float(b) for b in bounds_s], "pending": pending, "running": running,
    })
    return int(found[0])


async def rollup_last_minute(conn: Conn) -> datetime | None:
    """The newest minute a pass wrote; None before the first."""
    (minute,) = await fetch_scalars(conn, "rollup_last_minute")
    return minute if isinstance(minute, datetime) else None


async def rollup_prune(conn: Conn) -> None:
    await conn.execute(Q["rollup_prune"])


async def record_minutes(conn: Conn, settings: SweeperSettings, *, pending: int, running: int,
                         now: datetime | None = None) -> int:
    """Recounts the last minutes into minute_rollup (sweeper/rollup.py says
    which); the minutes written."""
    now = now or datetime.now(UTC)
    last_written = await rollup_last_minute(conn)
    from_minute, oldest = rollup.window(settings, now, last_written)
    bounds = await job_id_bounds(conn, created_after=oldest, created_before=None)
    # the jobs that can end after this pass, for the overview: those a pass
    # recounting only the late-commit window reads, however far back this one
    # recounts
    steady_minute, ending_oldest = rollup.window(settings, now)
    ending = bounds if steady_minute == from_minute else await job_id_bounds(
        conn, created_after=ending_oldest, created_before=None)
    written = await rollup_minutes(conn, from_minute=from_minute, from_id=bounds.lo_id, ending_from_id=ending.lo_id,
                                   bounds_s=ROLLUP_BOUNDS_S, pending=pending, running=running)
    await rollup_prune(conn)
    return written


# -- the interface ---------------------------------------------------------------


class SweeperStore(Protocol):
    async def probe(self, *, lock_timeout_s: float) -> datetime:
        """Raises unless a heartbeat could be written right now (within
        lock_timeout_s); returns the server's start time."""
        ...

    async def fail_stale(
        self, *, heartbeat_timeout_s: float, job_timeout_s: float, pending_timeout_s: float, judge_running: bool,
        batch_size: int, lock_timeout_s: float, now: datetime | None, batch_collect_s: float = 60.0,
    ) -> list[StaleJob]:
        """One batch of the sweeper's rules (the rules about running jobs only
        when judge_running), and the ledger rows its jobs left open closed."""
        ...

    async def queue_gauges(self, *, now: datetime | None) -> QueueGauges: ...

    async def record_minutes(self, settings: SweeperSettings, *, pending: int, running: int) -> int:
        """Recounts the console's history of the last minutes."""
        ...

    async def budget_days_today(self, *, now: datetime | None) -> list[BudgetDay]: ...

    async def webhook_delivery_gauges(self, *, now: datetime | None) -> WebhookDeliveryGauges: ...

    async def budget_over_reservation_total(self) -> Decimal: ...

    async def snapshot_ages(self) -> SnapshotAges:
        """What holds VACUUM back in the database: the oldest transaction and snapshot, the slots' xmin."""
        ...

    async def prune_finished(
        self, *, retention_s: float, batch_size: int, now: datetime | None,
    ) -> list[PrunedJob]:
        """Deletes one batch of jobs finished longer ago than retention_s; the jobs deleted."""
        ...


class PgSweeperStore:
    """SweeperStore on a connection pool."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self._pool = pool

    async def probe(self, *, lock_timeout_s: float) -> datetime:
        async with self._pool.connection() as conn:
            return await sweeper_probe(conn, lock_timeout_s=lock_timeout_s)

    async def fail_stale(
        self, *, heartbeat_timeout_s: float, job_timeout_s: float, pending_timeout_s: float, judge_running: bool,
        batch_size: int, lock_timeout_s: float, now: datetime | None, batch_collect_s: float = 60.0,
    ) -> list[StaleJob]:
        async with self._pool.connection() as conn:
            return await job_fail_stale(
                conn, heartbeat_timeout_s=heartbeat_timeout_s, job_timeout_s=job_timeout_s,
                pending_timeout_s=pending_timeout_s, judge_running=judge_running, batch_size=batch_size,
                lock_timeout_s=lock_timeout_s, now=now, batch_collect_s=batch_collect_s,
            )

    async def queue_gauges(self, *, now: datetime | None) -> QueueGauges:
        async with self._pool.connection() as conn:
            return await job_queue_gauges(conn, now=now)

    async def record_minutes(self, settings: SweeperSettings, *, pending: int, running: int) -> int:
        async with self._pool.connection() as conn:
            return await record_minutes(conn, settings, pending=pending, running=running)

    async def budget_days_today(self, *, now: datetime | None) -> list[BudgetDay]:
        async with self._pool.connection() as conn:
            return await budget_days_today(conn, now=now)

    async def webhook_delivery_gauges(self, *, now: datetime | None) -> WebhookDeliveryGauges:
        async with self._pool.connection() as conn:
            return await webhook_delivery_gauges(conn, now=now)

    async def budget_over_reservation_total(self) -> Decimal:
        async with self._pool.connection() as conn:
            return await budget_over_reservation_total(conn)

    async def snapshot_ages(self) -> SnapshotAges:
        async with self._pool.connection() as conn:
            return await database_snapshot_ages(conn)

    async def prune_finished(
        self, *, retention_s: float, batch_size: int, now: datetime | None,
    ) -> list[PrunedJob]:
        async with self._pool.connection() as conn:
            return await job_prune_finished_jobs(conn, retention_s=retention_s, batch_size=batch_size, now=now)
