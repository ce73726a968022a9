"""What operators read and do, from the console (api/ops/, its webhooks
screen in api/ops/webhooks.py) and from the ``storyjobs`` command
(tools/cli.py): ``ConsoleStore``, on one connection, with one small typed
function per query of sql/console.sql below, so that the two answer each
question with one query and one row type (shared/console_rows.py)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
from psycopg.rows import dict_row

from shared.config import BaseSettings
from shared.console_rows import (
    ClientToday,
    JobFilter,
    LlmCallRow,
    OperatorAction,
    OperatorActionRow,
    OperatorKeyAuth,
    OperatorKeyListRow,
    OpsBatchRow,
    OpsClient,
    OpsJobDetail,
    OpsJobRow,
    OpsOverviewRow,
    PendingCount,
    RateBucketRow,
    RollupMinuteRow,
    WebhookDeliveryRow,
    WebhookEndpointAdminRow,
    WorkerRow,
)
from shared.queries import QUERIES as Q
from shared.ratelimit import RateLimits
from shared.rows import BudgetDay, CancelResult, JobIdBounds, SnapshotAges

# Conn, budget_days_today and job_id_bounds are re-exported (`as` themselves):
# the console reads these common queries too, and its one store holds all it
# runs.
from shared.store import Conn as Conn
from shared.store import (
    api_client_weight_set,
    fetch_all,
    fetch_one,
    fetch_scalars,
    job_admission_lock,
    job_cancel,
    jsonb,
)
from shared.store import budget_days_today as budget_days_today
from shared.store import database_snapshot_ages as database_snapshot_ages
from shared.store import job_id_bounds as job_id_bounds

# a job finishes within PENDING_TIMEOUT_S + JOB_TIMEOUT_S of its creation, or
# the sweeper fails it at its next pass: this much later at worst, unless the
# sweeper is stopped
SWEEPER_LAG = timedelta(minutes=10)


def finished_since(settings: BaseSettings, window: timedelta) -> datetime:
    """The oldest creation time of a job that can have finished in the last
    ``window``: ops_overview's day_from_id is job_id_bounds' lo_id from it."""
    longest_life = timedelta(seconds=settings.pending_timeout_s + settings.job_timeout_s) + SWEEPER_LAG
    return datetime.now(UTC) - window - longest_life


def snapshot_warning(ages: SnapshotAges, warn_after_s: float) -> str | None:
    """The console's line (and `storyjobs stats`'s) when a transaction or a
    snapshot on the jobs' database is older than XMIN_HORIZON_WARN_S."""
    if not ages.known:
        return None
    oldest = max(ages.oldest_transaction_age_s or 0.0, ages.oldest_snapshot_age_s or 0.0)
    if oldest <= warn_after_s:
        return None
    return (f"a transaction or snapshot has been open for {oldest:.0f} s (XMIN_HORIZON_WARN_S {warn_after_s:g}): "
            "VACUUM removes no row changed since, so the live-jobs indexes grow and the claim slows. Find it "
            "with SELECT pid, usename, application_name, xact_start, state, query FROM pg_stat_activity "
            "WHERE backend_xmin IS NOT NULL ORDER BY xact_start, and end it (pg_terminate_backend)")


class ConsoleStore:
    """What operators read and do, on one connection: the request's under the
    console (api/ops/guard.py gives it, the operator's key checked on it), or
    the ``storyjobs`` command's. Every method may raise any of
    ``shared.db.DB_ERRORS``."""

    __slots__ = ("conn",)

    def __init__(self, conn: Conn) -> None:
        self.conn = conn

    def transaction(self) -> AbstractAsyncContextManager[Any]:
        """One transaction around the calls made inside it: an action and its
        record in operator_actions commit together or not at all."""
        return self.conn.transaction()

    # -- keys and clients

    async def api_key_revoke(self, *, key_prefix: str) -> bool:
        return await api_key_revoke(self.conn, key_prefix=key_prefix)

    async def api_key_revoke_for_client(self, *, client_id: int) -> list[str] | None:
        return await api_key_revoke_for_client(self.conn, client_id=client_id)

    async def api_client_weight_set(self, *, client_id: int, weight: int) -> bool:
        return await api_client_weight_set(self.conn, client_id=client_id, weight=weight)

    async def operator_key_get(self, *, key_prefix: str) -> OperatorKeyAuth | None:
        return await operator_key_get(self.conn, key_prefix=key_prefix)

    async def operator_key_list(self) -> list[OperatorKeyListRow]:
        return await operator_key_list(self.conn)

    async def operator_key_revoke(self, *, key_prefix: str) -> bool:
        return await operator_key_revoke(self.conn, key_prefix=key_prefix)

    async def ops_client_list(self) -> list[OpsClient]:
        return await ops_client_list(self.conn)

    async def ops_client_today(self, *, from_id: int, day_start: datetime) -> list[ClientToday]:
        return await ops_client_today(self.conn, from_id=from_id, day_start=day_start)

    # -- jobs

    async def job_id_bounds(self, *, created_after: datetime | None, created_before: datetime | None) -> JobIdBounds:
        return await job_id_bounds(self.conn, created_after=created_after, created_before=created_before)

    async def ops_job_list(
        self, *, filters: JobFilter, live: bool, before_id: int | None, limit: int, floor_id: int | None = None,
        before_created_at: datetime | None = None,
    ) -> list[OpsJobRow]:
        return await ops_job_list(self.conn, filters=filters, live=live, before_id=before_id, limit=limit,
                                  floor_id=floor_id, before_created_at=before_created_at)

    async def ops_job_get(self, *, job_id: uuid.UUID) -> OpsJobDetail | None:
        return await ops_job_get(self.conn, job_id=job_id)

    async def ops_batch_list(self, *, before_id: int | None, limit: int) -> list[OpsBatchRow]:
        return await ops_batch_list(self.conn, before_id=before_id, limit=limit)

    async def llm_call_list_for_job(self, *, job_id: int) -> list[LlmCallRow]:
        return await llm_call_list_for_job(self.conn, job_id=job_id)

    async def ops_job_cancel(self, *, job_id: uuid.UUID) -> CancelResult | None:
        return await ops_job_cancel(self.conn, job_id=job_id)

    async def ops_job_count_pending(self, *, filters: JobFilter) -> PendingCount:
        return await ops_job_count_pending(self.conn, filters=filters)

    async def ops_job_cancel_pending(self, *, filters: JobFilter, through_id: int) -> list[uuid.UUID]:
        return await ops_job_cancel_pending(self.conn, filters=filters, through_id=through_id)

    # -- overview, history, workers

    async def ops_overview(self, *, day_from_id: int) -> OpsOverviewRow:
        return await ops_overview(self.conn, day_from_id=day_from_id)

    async def budget_days_today(self) -> list[BudgetDay]:
        return await budget_days_today(self.conn)

    async def llm_rate_bucket_list(self, *, limits: RateLimits) -> list[RateBucketRow]:
        return await llm_rate_bucket_list(self.conn, limits=limits)

    async def ops_history(self, *, since: datetime, step: timedelta, origin: datetime) -> list[RollupMinuteRow]:
        return await ops_history(self.conn, since=since, step=step, origin=origin)

    async def database_snapshot_ages(self) -> SnapshotAges:
        return await database_snapshot_ages(self.conn)

    async def ops_writers_recent(self) -> list[str]:
        return await ops_writers_recent(self.conn)

    async def ops_workers(self) -> list[WorkerRow]:
        return await ops_workers(self.conn)

    # -- webhooks

    async def webhook_endpoint_list(self, *, client_id: int | None = None) -> list[WebhookEndpointAdminRow]:
        return await webhook_endpoint_list(self.conn, client_id=client_id)

    async def webhook_delivery_list(
        self, *, endpoint_id: uuid.UUID | None = None, state: str | None = None, limit: int = 50
    ) -> list[WebhookDeliveryRow]:
        return await webhook_delivery_list(self.conn, endpoint_id=endpoint_id, state=state, limit=limit)

    async def webhook_delivery_retry(self, *, delivery_id: int) -> uuid.UUID | None:
        return await webhook_delivery_retry(self.conn, delivery_id=delivery_id)

    # -- operators' actions

    async def operator_action_record(
        self, *, operator_key_id: int, action: OperatorAction, touched: int, job_id: uuid.UUID | None = None,
        filter: Mapping[str, Any] | None = None,
    ) -> None:
        await operator_action_record(self.conn, operator_key_id=operator_key_id, action=action, touched=touched,
                                     job_id=job_id, filter=filter)

    async def operator_action_list(self, *, limit: int, before_id: int | None = None) -> list[OperatorActionRow]:
        return await operator_action_list(self.conn, limit=limit, before_id=before_id)


# -- keys ----------------------------------------------------------------------------


async def api_key_revoke(conn: Conn, *, key_prefix: str) -> bool:
    return bool(await fetch_scalars(conn, "api_key_revoke", {"key_prefix": key_prefix}))


async def api_key_revoke_for_client(conn: Conn, *, client_id: int) -> list[str] | None:
    """Revokes the client's active keys; returns their prefixes (None: no
    such client)."""
    found = await fetch_scalars(conn, "api_key_revoke_for_client", {"client_id": client_id})
    return list(found[0]) if found else None


async def operator_key_get(conn: Conn, *, key_prefix: str) -> OperatorKeyAuth | None:
    return await fetch_one(conn, OperatorKeyAuth, "operator_key_get", {"key_prefix": key_prefix})


async def operator_key_list(conn: Conn) -> list[OperatorKeyListRow]:
    return await fetch_all(conn, OperatorKeyListRow, "operator_key_list", {})


async def operator_key_revoke(conn: Conn, *, key_prefix: str) -> bool:
    return bool(await fetch_scalars(conn, "operator_key_revoke", {"key_prefix": key_prefix}))


# -- jobs ----------------------------------------------------------------------------


async def llm_call_list_for_job(conn: Conn, *, job_id: int) -> list[LlmCallRow]:
    return await fetch_all(conn, LlmCallRow, "llm_call_list_for_job", {"job_id": job_id})


def _filter_params(filters: JobFilter) -> dict[str, Any]:
    return msgspec.structs.asdict(filters)


async def ops_job_list(
    conn: Conn, *, filters: JobFilter, live: bool, before_id: int | None, limit: int, floor_id: int | None = None,
    before_created_at: datetime | None = None,
) -> list[OpsJobRow]:
    """Jobs matching filters, newest first. History (not ``live``): by id,
    floor_id <= id < before_id. ``live``: jobs of one live status
    (filters.status) by (created_at, id) below (before_created_at,
    before_id); None: from the newest."""
    params = {**_filter_params(filters), "live": live, "before_id": before_id, "floor_id": floor_id,
              "before_created_at": before_created_at, "limit": limit}
    return await fetch_all(conn, OpsJobRow, "ops_job_list", params)


async def ops_job_get(conn: Conn, *, job_id: uuid.UUID) -> OpsJobDetail | None:
    return await fetch_one(conn, OpsJobDetail, "ops_job_get", {"job_id": job_id})


async def ops_job_cancel(conn: Conn, *, job_id: uuid.UUID) -> CancelResult | None:
    """An operator's cancellation, whoever's the job: as job_cancel, the
    ledger row of a call left open closed in the same transaction. None: no
    such job."""
    return await job_cancel(conn, client_id=None, job_id=job_id)


async def ops_job_count_pending(conn: Conn, *, filters: JobFilter) -> PendingCount:
    # status and error_code are not read: the count is of pending jobs
    row = await fetch_one(conn, PendingCount, "ops_job_count_pending", _filter_params(filters))
    assert row is not None
    return row


async def ops_job_cancel_pending(conn: Conn, *, filters: JobFilter, through_id: int) -> list[uuid.UUID]:
    """Cancels the pending jobs matching filters (client and time range) up
    to through_id, under the admission lock (their turns are given back);
    returns the job ids it cancelled."""
    async with conn.transaction():
        await job_admission_lock(conn)
        return await fetch_scalars(conn, "ops_job_cancel_pending",
                                   {**_filter_params(filters), "through_id": through_id})


async def ops_client_list(conn: Conn) -> list[OpsClient]:
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(Q["ops_client_list"], {})
        rows = await cur.fetchall()
    # the keys arrive as one JSON array per client
    return msgspec.convert(rows, list[OpsClient])


# -- overview, history, workers ------------------------------------------------------


async def ops_overview(conn: Conn, *, day_from_id: int) -> OpsOverviewRow:
    row = await fetch_one(conn, OpsOverviewRow, "ops_overview", {"day_from_id": day_from_id})
    assert row is not None
    return row


async def llm_rate_bucket_list(conn: Conn, *, limits: RateLimits) -> list[RateBucketRow]:
    """The buckets, refilled to now at these limits' rates (a kind without one: as stored)."""
    return await fetch_all(conn, RateBucketRow, "llm_rate_bucket_list", msgspec.structs.asdict(limits))


async def ops_history(conn: Conn, *, since: datetime, step: timedelta, origin: datetime) -> list[RollupMinuteRow]:
    """The rollup from since, summed into buckets of step aligned on origin
    (each row's minute is its bucket's start)."""
    return await fetch_all(conn, RollupMinuteRow, "ops_history", {"since": since, "step": step, "origin": origin})


async def ops_writers_recent(conn: Conn) -> list[str]:
    return [str(provider) for provider in await fetch_scalars(conn, "ops_writers_recent")]


async def ops_client_today(conn: Conn, *, from_id: int, day_start: datetime) -> list[ClientToday]:
    return await fetch_all(conn, ClientToday, "ops_client_today", {"from_id": from_id, "day_start": day_start})


async def ops_workers(conn: Conn) -> list[WorkerRow]:
    return await fetch_all(conn, WorkerRow, "ops_workers", {})


# -- the batch lane ------------------------------------------------------------------


async def ops_batch_list(conn: Conn, *, before_id: int | None, limit: int) -> list[OpsBatchRow]:
    """Message batches newest first, below before_id (None: from the newest)."""
    return await fetch_all(conn, OpsBatchRow, "ops_batch_list", {"before_id": before_id, "limit": limit})


# -- webhooks ------------------------------------------------------------------------


async def webhook_endpoint_list(conn: Conn, *, client_id: int | None = None) -> list[WebhookEndpointAdminRow]:
    return await fetch_all(conn, WebhookEndpointAdminRow, "webhook_endpoint_list", {"client_id": client_id})


async def webhook_delivery_list(
    conn: Conn, *, endpoint_id: uuid.UUID | None = None, state: str | None = None, limit: int = 50
) -> list[WebhookDeliveryRow]:
    return await fetch_all(conn, WebhookDeliveryRow, "webhook_delivery_list",
                      {"endpoint_id": endpoint_id, "state": state, "limit": limit})


async def webhook_delivery_retry(conn: Conn, *, delivery_id: int) -> uuid.UUID | None:
    """dead -> pending, due now; the delivery's job (its public id), or None:
    no dead delivery of that id. Record the operator's action in the same
    transaction."""
    found = await fetch_scalars(conn, "webhook_delivery_retry", {"delivery_id": delivery_id})
    return uuid.UUID(str(found[0])) if found else None


# -- operators' actions --------------------------------------------------------------


async def operator_action_record(
    conn: Conn, *, operator_key_id: int, action: OperatorAction, touched: int, job_id: uuid.UUID | None = None,
    filter: Mapping[str, Any] | None = None,
) -> None:
    """Records an operator's action; run it in the action's transaction."""
    await conn.execute(Q["operator_action_insert"], {
        "operator_key_id": operator_key_id, "action": action, "job_id": job_id,
        "filter": None if filter is None else jsonb(filter), "touched": touched})


async def operator_action_list(conn: Conn, *, limit: int, before_id: int | None = None) -> list[OperatorActionRow]:
    return await fetch_all(conn, OperatorActionRow, "operator_action_list", {"limit": limit, "before_id": before_id})
