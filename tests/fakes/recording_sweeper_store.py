"""An in-memory SweeperStore that records what the sweeper asked of it.

A test says what the database answers (the stale jobs of each batch, what
each prune deletes, the server's start time) and can make the next call of a
method fail, as a lock timeout or a lost connection would; it then reads the
calls the sweeper made, in order, with their arguments.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from shared.config import SweeperSettings
from shared.rows import BudgetDay, SnapshotAges
from shared.status import ErrorCode
from sweeper.partitions import StoryPartitionsKept
from sweeper.rows import LedgerPruned, PrunedJob, QueueGauges, StaleJob, WebhookDeliveryGauges
from sweeper.store import SweeperStore

SERVER_STARTED_AT = datetime(2026, 1, 1, tzinfo=UTC)
LEDGER_STARTED_AT = datetime(2025, 12, 1, tzinfo=UTC)


def stale(reason: ErrorCode, worker_id: str | None = "w-1", trace_context: object = None) -> StaleJob:
    return StaleJob(id=0, public_id=uuid.uuid4(), reason=reason, worker_id=worker_id, trace_context=trace_context)


class RecordingSweeperStore:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        # what the next fail_stale calls answer, one batch each (then none)
        self.stale_batches: list[list[StaleJob]] = []
        # what the next prune_finished calls delete: how many jobs (then 0),
        # or the jobs themselves (prune_batches, read first)
        self.prune_counts: list[int] = []
        self.prune_batches: list[list[PrunedJob]] = []
        # where prune_below_id says the prune's walk ends
        self.prune_below = 1_000
        self.server_started_at = SERVER_STARTED_AT
        self.gauges = QueueGauges(pending=0, running=0, oldest_pending_age_seconds=0.0)
        self.budget_days: list[BudgetDay] = []
        self.outbox = WebhookDeliveryGauges(undelivered=0, oldest_undelivered_age_seconds=0.0)
        self.over_reservation = Decimal(0)
        self.snapshots = SnapshotAges(known=True, oldest_transaction_age_s=None, oldest_snapshot_age_s=None,
                                      replication_slot_xmin_age=None)
        self.partitions_kept = StoryPartitionsKept(added=0, dropped=0, behind=False)
        # None: the admission lock was not had in time
        self.claim_floor: float | None = 0.0
        # what each ledger prune batch deletes, in order; 0 once they run out
        self.ledger_batches: list[int] = []
        self._faults: dict[str, list[Exception]] = {}

    # -- what tests use ---------------------------------------------------------------

    def fail_next(self, method: str, error: Exception) -> None:
        self._faults.setdefault(method, []).append(error)

    def named(self, method: str) -> list[dict[str, Any]]:
        return [arguments for name, arguments in self.calls if name == method]

    def _call(self, method: str, **arguments: Any) -> None:
        self.calls.append((method, arguments))
        if self._faults.get(method):
            raise self._faults[method].pop(0)

    # -- SweeperStore -----------------------------------------------------------------

    async def probe(self, *, lock_timeout_s: float) -> datetime:
        self._call("probe", lock_timeout_s=lock_timeout_s)
        return self.server_started_at

    async def fail_stale(
        self, *, heartbeat_timeout_s: float, job_timeout_s: float, pending_timeout_s: float, judge_running: bool,
        batch_size: int, lock_timeout_s: float, now: datetime | None, batch_collect_s: float = 60.0,
    ) -> list[StaleJob]:
        self._call("fail_stale", heartbeat_timeout_s=heartbeat_timeout_s, job_timeout_s=job_timeout_s,
                   pending_timeout_s=pending_timeout_s, judge_running=judge_running, batch_size=batch_size,
                   lock_timeout_s=lock_timeout_s, now=now, batch_collect_s=batch_collect_s)
        batch = self.stale_batches.pop(0) if self.stale_batches else []
        # as the SQL does: the rules about running jobs only when judged
        return [job for job in batch if judge_running or job.reason == ErrorCode.QUEUE_TIMEOUT][:batch_size]

    async def advance_claim_floor(self, *, lock_timeout_s: float) -> float | None:
        self._call("advance_claim_floor", lock_timeout_s=lock_timeout_s)
        return self.claim_floor

    async def queue_gauges(self, *, now: datetime | None) -> QueueGauges:
        self._call("queue_gauges", now=now)
        return self.gauges

    async def record_minutes(self, settings: SweeperSettings, *, pending: int, running: int) -> int:
        self._call("record_minutes", pending=pending, running=running)
        return 1

    async def budget_days_today(self, *, now: datetime | None) -> list[BudgetDay]:
        self._call("budget_days_today", now=now)
        return self.budget_days

    async def webhook_delivery_gauges(self, *, now: datetime | None) -> WebhookDeliveryGauges:
        self._call("webhook_delivery_gauges", now=now)
        return self.outbox

    async def budget_over_reservation_total(self) -> Decimal:
        self._call("budget_over_reservation_total")
        return self.over_reservation

    async def snapshot_ages(self) -> SnapshotAges:
        self._call("snapshot_ages")
        return self.snapshots

    async def prune_below_id(self, *, retention_s: float, now: datetime | None) -> int:
        self._call("prune_below_id", retention_s=retention_s, now=now)
        return self.prune_below

    async def prune_finished(
        self, *, retention_s: float, batch_size: int, now: datetime | None, below_id: int | None = None,
        after_id: int = 0,
    ) -> list[PrunedJob]:
        self._call("prune_finished", retention_s=retention_s, batch_size=batch_size, now=now, below_id=below_id,
                   after_id=after_id)
        if self.prune_batches:
            return self.prune_batches.pop(0)
        count = self.prune_counts.pop(0) if self.prune_counts else 0
        return [PrunedJob(id=n + 1) for n in range(count)]

    async def keep_story_partitions(self, *, retention_s: float, now: datetime | None) -> StoryPartitionsKept:
        self._call("keep_story_partitions", retention_s=retention_s, now=now)
        return self.partitions_kept

    async def prune_ledger(
        self, *, retention_s: float, batch_size: int, now: datetime | None, after: datetime | None = None,
    ) -> LedgerPruned:
        self._call("prune_ledger", retention_s=retention_s, batch_size=batch_size, now=now, after=after)
        deleted = self.ledger_batches.pop(0) if self.ledger_batches else 0
        # each batch's latest start a minute past the one before's
        latest = LEDGER_STARTED_AT + timedelta(minutes=len(self.named("prune_ledger")))
        return LedgerPruned(deleted=deleted, last_started_at=latest if deleted else None)


# mypy rejects this line when the fake drifts from the interface it stands for
_: SweeperStore = RecordingSweeperStore()
