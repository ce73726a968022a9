"""What the sweeper asks of the database, as one typed interface.

``SweeperStore`` is everything a pass and a probe need (sweeper/sweep.py);
``PgSweeperStore`` does it with the sweeper's named queries
(sql/sweeper.sql), one method per query, on a connection pool (or, for a
test, one connection). A recording fake of the same interface
(tests/fakes/recording_sweeper_store.py) lets the sweeper's rules be tested
without a database. Every method may raise any of ``shared.db.DB_ERRORS``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Protocol

from shared.config import SweeperSettings
from shared.queries import QUERIES as Q
from shared.rows import ROLLUP_BOUNDS_S, BudgetDay, SnapshotAges
from shared.store import (
    Conn,
    Connections,
    budget_days_today,
    connection,
    database_snapshot_ages,
    fetch_all,
    fetch_one,
    fetch_scalars,
    job_admission_lock,
    job_id_bounds,
    lock_timeout_set,
    within_lock_timeout,
)
from sweeper import partitions, rollup
from sweeper.partitions import StoryPartitionsKept
from sweeper.rows import LedgerPruned, PrunedJob, QueueGauges, StaleJob, WebhookDeliveryGauges


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

    async def advance_claim_floor(self, *, lock_timeout_s: float) -> float | None:
        """Raises the turn the claim's walk starts at to the smallest pending one, under the admission lock
        (waited for at most lock_timeout_s); the floor after, or None when a lock was not had in time."""
        ...

    async def prune_below_id(self, *, retention_s: float, now: datetime | None) -> int:
        """An id above every job that retention_s lets the prune delete: where its walk ends."""
        ...

    async def prune_finished(
        self, *, retention_s: float, batch_size: int, now: datetime | None, below_id: int | None = None,
        after_id: int = 0,
    ) -> list[PrunedJob]:
        """Deletes one batch of jobs finished longer ago than retention_s, above after_id (the last job the
        pass's batch before deleted) and below below_id (prune_below_id's, read once for a pass's batches;
        None: read for this batch); the jobs deleted."""
        ...

    async def keep_story_partitions(self, *, retention_s: float, now: datetime | None) -> StoryPartitionsKept:
        """Bounds, adds and drops the stories' partitions (sweeper/partitions.py)."""
        ...

    async def prune_ledger(
        self, *, retention_s: float, batch_size: int, now: datetime | None, after: datetime | None = None,
    ) -> LedgerPruned:
        """Deletes up to batch_size ledger rows of interactive calls started longer ago than retention_s whose
        job is gone (LEDGER_RETENTION_S), walking from after (the latest start the pass's batch before deleted;
        None: the oldest); how many, and the latest start among them."""
        ...


class PgSweeperStore:
    """SweeperStore on a connection pool, or on one connection (a test's,
    whose transactions and locks it then shares). ``now`` defaults to the
    database's clock."""

    def __init__(self, connections: Connections) -> None:
        self._connections = connections

    async def probe(self, *, lock_timeout_s: float) -> datetime:
        async with connection(self._connections) as conn:
            async with conn.pipeline(), conn.transaction():
                await lock_timeout_set(conn, lock_timeout_s)
                cur = await conn.execute(Q["sweeper_probe"])
            row = await cur.fetchone()
        assert row is not None
        started_at: datetime = row[0]
        return started_at

    async def fail_stale(
        self, *, heartbeat_timeout_s: float, job_timeout_s: float, pending_timeout_s: float, judge_running: bool,
        batch_size: int, lock_timeout_s: float, now: datetime | None = None, batch_collect_s: float = 60.0,
    ) -> list[StaleJob]:
        """In one transaction whose statements wait at most lock_timeout_s
        for a lock."""
        async with connection(self._connections) as conn, conn.transaction():
            await lock_timeout_set(conn, lock_timeout_s)
            return await fetch_all(conn, StaleJob, "job_fail_stale", {
                "heartbeat_timeout_s": heartbeat_timeout_s, "job_timeout_s": job_timeout_s,
                "pending_timeout_s": pending_timeout_s, "judge_running": judge_running, "batch_size": batch_size,
                "batch_collect_s": batch_collect_s, "now": now})

    async def queue_gauges(self, *, now: datetime | None = None) -> QueueGauges:
        async with connection(self._connections) as conn:
            row = await fetch_one(conn, QueueGauges, "job_queue_gauges", {"now": now})
        assert row is not None
        return row

    async def record_minutes(self, settings: SweeperSettings, *, pending: int, running: int) -> int:
        """Recounts the last minutes into minute_rollup (sweeper/rollup.py
        says which, by this process's clock), then drops the minutes past its
        keep; the minutes written."""
        now = datetime.now(UTC)
        async with connection(self._connections) as conn:
            # the newest minute a pass wrote; None before the first
            (last_written,) = await fetch_scalars(conn, "rollup_last_minute")
            from_minute, oldest = rollup.window(
                settings, now, last_written if isinstance(last_written, datetime) else None)
            bounds = await job_id_bounds(conn, created_after=oldest, created_before=None)
            # the jobs that can end after this pass, for the overview: those a
            # pass recounting only the late-commit window reads, however far
            # back this one recounts
            steady_minute, ending_oldest = rollup.window(settings, now)
            ending = bounds if steady_minute == from_minute else await job_id_bounds(
                conn, created_after=ending_oldest, created_before=None)
            (written,) = await fetch_scalars(conn, "rollup_minutes", {
                "from_minute": from_minute, "from_id": bounds.lo_id, "ending_from_id": ending.lo_id,
                "bounds_s": [float(b) for b in ROLLUP_BOUNDS_S], "pending": pending, "running": running,
            })
            await conn.execute(Q["rollup_prune"])
        return int(written)

    async def budget_days_today(self, *, now: datetime | None = None) -> list[BudgetDay]:
        async with connection(self._connections) as conn:
            return await budget_days_today(conn, now=now)

    async def webhook_delivery_gauges(self, *, now: datetime | None = None) -> WebhookDeliveryGauges:
        async with connection(self._connections) as conn:
            row = await fetch_one(conn, WebhookDeliveryGauges, "webhook_delivery_gauges", {"now": now})
        assert row is not None
        return row

    async def budget_over_reservation_total(self) -> Decimal:
        async with connection(self._connections) as conn:
            (total,) = await fetch_scalars(conn, "budget_over_reservation_total")
        return Decimal(total)

    async def snapshot_ages(self) -> SnapshotAges:
        async with connection(self._connections) as conn:
            return await database_snapshot_ages(conn)

    async def advance_claim_floor(self, *, lock_timeout_s: float) -> float | None:
        async def advanced(conn: Conn) -> float:
            await job_admission_lock(conn)
            (turn,) = await fetch_scalars(conn, "job_claim_floor_advance")
            return float(turn)

        async with connection(self._connections) as conn:
            return await within_lock_timeout(conn, lock_timeout_s, lambda: advanced(conn))

    async def prune_below_id(self, *, retention_s: float, now: datetime | None = None) -> int:
        """Found by this process's clock, with job_id_bounds' margin: the
        statement judges each job by the database's."""
        cutoff = (now or datetime.now(UTC)) - timedelta(seconds=retention_s)
        async with connection(self._connections) as conn:
            return (await job_id_bounds(conn, created_after=None, created_before=cutoff)).hi_id

    async def prune_finished(
        self, *, retention_s: float, batch_size: int, now: datetime | None = None, below_id: int | None = None,
        after_id: int = 0,
    ) -> list[PrunedJob]:
        """Each job deleted comes with its trace context."""
        if below_id is None:
            below_id = await self.prune_below_id(retention_s=retention_s, now=now)
        async with connection(self._connections) as conn:
            return await fetch_all(conn, PrunedJob, "job_prune_finished", {
                "retention_s": retention_s, "batch_size": batch_size, "now": now, "below_id": below_id,
                "after_id": after_id})

    async def keep_story_partitions(
        self, *, retention_s: float, now: datetime | None = None,
    ) -> StoryPartitionsKept:
        async with connection(self._connections) as conn:
            return await partitions.keep(conn, retention_s=retention_s, now=now)

    async def prune_ledger(
        self, *, retention_s: float, batch_size: int, now: datetime | None = None, after: datetime | None = None,
    ) -> LedgerPruned:
        async with connection(self._connections) as conn:
            pruned = await fetch_one(conn, LedgerPruned, "ledger_prune", {
                "retention_s": retention_s, "batch_size": batch_size, "now": now, "after": after})
        assert pruned is not None  # an aggregate's one row
        return pruned
