"""The sweeper's rows (sweeper/store.py): stale jobs and the gauges. The rows
the console reads too are in shared/rows.py."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import msgspec

from shared.status import ErrorCode


class StaleJob(msgspec.Struct, frozen=True):
    id: int
    public_id: uuid.UUID
    reason: ErrorCode
    worker_id: str | None
    # the job's stored trace context (shared/telemetry.py): any jsonb value,
    # read with telemetry.link_from_carrier, which ignores what is not one
    trace_context: Any = None


class PrunedJob(msgspec.Struct, frozen=True):
    id: int
    trace_context: Any = None


class LedgerPruned(msgspec.Struct, frozen=True):
    deleted: int
    # the latest start among the rows deleted (None when none was): where
    # the pass's next batch walks on from
    last_started_at: datetime | None


class QueueGauges(msgspec.Struct, frozen=True):
    pending: int
    running: int
    oldest_pending_age_seconds: float


class WebhookDeliveryGauges(msgspec.Struct, frozen=True):
    undelivered: int
    oldest_undelivered_age_seconds: float
