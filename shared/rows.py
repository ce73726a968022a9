"""The rows that more than one caller reads (shared/store.py's queries, the
console's and the sweeper's alike).

Each caller keeps its own rows beside its store: api/rows.py,
shared/console_rows.py, sweeper/rows.py, worker/rows.py,
worker/delivery/rows.py, worker/batch/rows.py."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal

import msgspec

from shared.status import JobStatus


class KeyAuth(msgspec.Struct, frozen=True):
    """The authentication part of every api lookup."""

    client_id: int
    key_hash: bytes
    revoked: bool


class CancelResult(msgspec.Struct, frozen=True):
    previous_status: JobStatus
    cancelled: bool


# -- read by the console and the sweeper ---------------------------------------------


class JobIdBounds(msgspec.Struct, frozen=True):
    """Every job created in the asked time range has lo_id <= id < hi_id."""

    lo_id: int
    hi_id: int


class SnapshotAges(msgspec.Struct, frozen=True):
    """What holds VACUUM back (database_snapshot_ages): ages in seconds,
    the replication slots' in transactions; None: nothing open. Meaningless
    unless ``known`` (the role can read other roles' sessions)."""

    known: bool
    oldest_transaction_age_s: float | None
    oldest_snapshot_age_s: float | None
    replication_slot_xmin_age: int | None


class BudgetDay(msgspec.Struct, frozen=True):
    """Today's spend of all clients (scope 'all', client_id 0) or of one."""

    scope: str
    client_id: int
    spent_usd: Decimal
    reserved_usd: Decimal
    client_budget_usd: Decimal | None


# how far back the minute rollup keeps and recounts (sweeper/rollup.py; the
# statements of sql/sweeper.sql say '8 days')
ROLLUP_KEPT_S = 8 * 24 * 3600.0

# The wait and run time buckets' lower bounds, in seconds: a minute_rollup
# row holds how many jobs fell in each, so that percentiles over any range
# are sums of rows (to the bucket's bound; api/ops/history.py reads them).
ROLLUP_BOUNDS_S: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0,
                                      120.0, 180.0, 300.0, 450.0, 600.0, 900.0, 1200.0, 1800.0, 3600.0)


# -- webhooks ---------------------------------------------------------------


class WebhookEndpointRow(msgspec.Struct, frozen=True):
    """A client's endpoint as the client sees it: never its secret."""

    id: uuid.UUID
    url: str
    events: list[str]
    created_at: datetime
    # it answered 410 Gone: nothing more is sent to it
    disabled_at: datetime | None
    # a delivery ran out of retries; cleared by the next success
    failing_since: datetime | None


