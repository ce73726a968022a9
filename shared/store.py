"""The only module that runs SQL: one small typed function per named query.

Functions take an open connection (autocommit, from shared.db) so the caller
decides which pool, and tests can hold locks on a second connection to force a
race. Every status change returns what it changed; an empty answer is a lost
race, which the caller logs and counts, never raises.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, TypeVar

import msgspec
from psycopg import AsyncConnection
from psycopg.rows import BaseRowFactory, dict_row, scalar_row
from psycopg.types.json import Jsonb

from shared.queries import QUERIES as Q
from shared.ratelimit import NO_LIMITS, UNLIMITED, LimiterState, RateLimits
from shared.rows import (
    Admission,
    BudgetDay,
    CancelResult,
    ClaimedJob,
    ClientToday,
    Completion,
    DeliveryOutcome,
    DrainStats,
    EnqueueResult,
    Failure,
    HeartbeatRow,
    HourStats,
    IdempotentLookup,
    JobAdminRow,
    JobFilter,
    JobIdBounds,
    JobListRow,
    JobView,
    KeyAuth,
    KeyListRow,
    LlmCallRow,
    OperatorAction,
    OperatorActionRow,
    OperatorKeyAuth,
    OperatorKeyListRow,
    OpsClient,
    OpsJobDetail,
    OpsJobRow,
    OpsOverviewRow,
    PendingCount,
    QueueGauges,
    RateBucketRow,
    RetryStart,
    RollupMinuteRow,
    SettleResult,
    StaleJob,
    StoryView,
    WebhookDeliveryClaim,
    WebhookDeliveryGauges,
    WebhookDeliveryRow,
    WebhookEndpointAdminRow,
    WebhookEndpointRow,
    WorkerRow,
)
from shared.status import JobStatus, LlmOutcome

Conn = AsyncConnection[Any]
R = TypeVar("R")

# pg_advisory_xact_lock key for admissions: any constant unique to storyjobs
ADMISSION_LOCK_KEY = 0x5354_4F52_594A_4F42  # "STORYJOB"
MIGRATION_LOCK_KEY = 0x5354_4F52_594D_4947  # "STORYMIG"


def struct_row(row_type: type[R]) -> BaseRowFactory[R]:
    """Rows as msgspec Structs, converted by msgspec: a status arrives as a
    JobStatus, an error code as an ErrorCode, not as the text Postgres sent."""

    def factory(cursor: Any) -> Any:
        # the names straight from the result: cursor.description would build
        # a Column object per column, on every statement
        result = cursor.pgresult
        names = [(result.fname(i) or b"").decode() for i in range(result.nfields)] if result is not None else []

        def make_row(values: Sequence[Any]) -> R:
            return msgspec.convert(dict(zip(names, values, strict=True)), row_type)

        return make_row

    return factory


async def _one(conn: Conn, row_type: type[R], query: str, params: dict[str, Any]) -> R | None:
    async with conn.cursor(row_factory=struct_row(row_type)) as cur:
        await cur.execute(Q[query], params)
        return await cur.fetchone()


async def _all(conn: Conn, row_type: type[R], query: str, params: dict[str, Any]) -> list[R]:
    async with conn.cursor(row_factory=struct_row(row_type)) as cur:
        await cur.execute(Q[query], params)
        return await cur.fetchall()


async def _scalars(conn: Conn, query: str, params: dict[str, Any] | None = None) -> list[Any]:
    async with conn.cursor(row_factory=scalar_row) as cur:
        await cur.execute(Q[query], params or {})
        return await cur.fetchall()


# -- schema ------------------------------------------------------------------


async def schema_version_get(conn: Conn) -> int | None:
    (version,) = await _scalars(conn, "schema_version_get")
    return None if version is None else int(version)


async def schema_migrations_create(conn: Conn) -> None:
    await conn.execute(Q["schema_migrations_create"])


async def schema_migrations_lock(conn: Conn) -> None:
    await conn.execute(Q["schema_migrations_lock"], {"lock_key": MIGRATION_LOCK_KEY})


async def schema_migrations_unlock(conn: Conn) -> None:
    await conn.execute(Q["schema_migrations_unlock"], {"lock_key": MIGRATION_LOCK_KEY})


async def schema_migrations_applied(conn: Conn) -> list[int]:
    return await _scalars(conn, "schema_migrations_applied")


async def schema_migration_apply(conn: Conn, *, version: int, name: str, ddl: str) -> None:
    """Runs one migration file and records it, in one transaction."""
    async with conn.transaction():
        # A migration file is trusted DDL from sql/, never built from input.
        await conn.execute(ddl.encode())
        await conn.execute(Q["schema_migrations_record"], {"version": version, "name": name})


async def job_status_enum_values(conn: Conn) -> list[str]:
    return await _scalars(conn, "job_status_enum_values")


# -- api keys ------------------------------------------------------------------


async def api_client_upsert(conn: Conn, *, name: str) -> int:
    (client_id,) = await _scalars(conn, "api_client_upsert", {"name": name})
    return int(client_id)


async def api_client_budget_set(conn: Conn, *, client_id: int, budget_usd_per_day: Decimal) -> None:
    await conn.execute(Q["api_client_budget_set"], {"client_id": client_id, "budget_usd_per_day": budget_usd_per_day})


async def api_client_weight_set(conn: Conn, *, client_id: int, weight: int) -> None:
    await conn.execute(Q["api_client_weight_set"], {"client_id": client_id, "weight": weight})


async def api_key_insert(conn: Conn, *, client_id: int, key_prefix: str, key_hash: bytes) -> None:
    await conn.execute(
        Q["api_key_insert"], {"client_id": client_id, "key_prefix": key_prefix, "key_hash": key_hash}
    )


async def api_key_list(conn: Conn) -> list[KeyListRow]:
    return await _all(conn, KeyListRow, "api_key_list", {})


async def api_key_revoke(conn: Conn, *, key_prefix: str) -> bool:
    return bool(await _scalars(conn, "api_key_revoke", {"key_prefix": key_prefix}))


async def api_key_get(conn: Conn, *, key_prefix: str) -> KeyAuth | None:
    return await _one(conn, KeyAuth, "api_key_get", {"key_prefix": key_prefix})


# -- api: jobs and stories -------------------------------------------------------


async def job_get_by_idempotency_key_for_key(
    conn: Conn, *, key_prefix: str, idempotency_key: str
) -> IdempotentLookup | None:
    return await _one(
        conn,
        IdempotentLookup,
        "job_get_by_idempotency_key_for_key",
        {"key_prefix": key_prefix, "idempotency_key": idempotency_key},
    )


async def job_insert_if_admitted(
    conn: Conn, *, admissions: Sequence[Admission], queue_max: int, client_queue_max: int,
    budget_usd: Decimal | None = None, client_budget_usd: Decimal | None = None,
) -> list[EnqueueResult]:
    """Takes the admission lock, then admits the batch in order while the
    queues and the spend budgets have room, in one transaction sent as a
    single pipelined round trip. One result per admission, in the same
    order. The batch must not hold one (client, key) twice."""
    requests = [
        {
            "ord": ord_,
            "client_id": a.client_id,
            "idempotency_key": a.idempotency_key,
            "request_fingerprint": a.request_fingerprint.hex(),
            "request": msgspec.Raw(a.request_json.encode()),
            "max_tokens": a.max_tokens,
            "input_tokens_estimate": a.input_tokens_estimate,
            "worst_case_usd": a.worst_case_usd,
            "model": a.model,
            "input_usd_per_mtok": a.input_usd_per_mtok,
            "output_usd_per_mtok": a.output_usd_per_mtok,
        }
        for ord_, a in enumerate(admissions)
    ]
    params = {"requests": _json(requests), "queue_max": queue_max, "client_queue_max": client_queue_max,
              "budget_usd": budget_usd, "client_budget_usd": client_budget_usd}
    async with conn.pipeline(), conn.transaction():
        await conn.execute(Q["job_admission_lock"], {"lock_key": ADMISSION_LOCK_KEY})
        cur = conn.cursor(row_factory=struct_row(EnqueueResult))
        await cur.execute(Q["job_insert_if_admitted"], params)
    return await cur.fetchall()


async def job_get_for_key(conn: Conn, *, key_prefix: str, job_id: uuid.UUID) -> JobView | None:
    return await _one(conn, JobView, "job_get_for_key", {"key_prefix": key_prefix, "job_id": job_id})


async def job_cancel(conn: Conn, *, client_id: int, job_id: uuid.UUID) -> CancelResult | None:
    """pending or running -> failed (cancelled), and the ledger row of a call
    left open closed, in one transaction sent as one round trip. None: no
    such job for this client."""
    return await _cancel(conn, "job_cancel", {"client_id": client_id, "job_id": job_id})


async def _cancel(conn: Conn, query: str, params: dict[str, Any]) -> CancelResult | None:
    async with conn.pipeline(), conn.transaction():
        cur = conn.cursor(row_factory=struct_row(CancelResult))
        await cur.execute(Q[query], params)
        await conn.execute(Q["llm_call_close_for_cancelled_job"], params)
    return await cur.fetchone()


async def story_get_for_key(conn: Conn, *, key_prefix: str, story_id: uuid.UUID) -> StoryView | None:
    return await _one(conn, StoryView, "story_get_for_key", {"key_prefix": key_prefix, "story_id": story_id})


async def job_drain_stats(conn: Conn, *, model: str = "") -> DrainStats:
    row = await _one(conn, DrainStats, "job_drain_stats", {"model": model})
    assert row is not None
    return row


# -- worker ------------------------------------------------------------------------


_claimed_decoder = msgspec.json.Decoder(list[ClaimedJob])
_limiter_decoder = msgspec.json.Decoder(LimiterState)
_json_encoder = msgspec.json.Encoder(decimal_format="number")


def _json(value: object) -> Jsonb:
    """A batch of records as one jsonb parameter (read with jsonb_to_recordset):
    one value to encode instead of an array per column."""
    return Jsonb(value, dumps=_json_encoder.encode)


def settle_and_claim_query(limiter: Mapping[str, Any]) -> str:
    """The round statement's name: without a configured rate limit, the one
    without the limiter's arithmetic."""
    return "job_settle_and_claim_limited" if limiter["limited"] else "job_settle_and_claim"


async def job_settle_and_claim(
    conn: Conn,
    *,
    worker_id: str,
    completions: Sequence[Completion],
    claim_limit: int,
    provider: str,
    model: str,
    limiter: Mapping[str, Any] = UNLIMITED,
) -> SettleResult:
    """Completes written stories and claims up to claim_limit pending jobs
    that the shared rate bucket covers (``limiter``: shared.ratelimit's
    claim_params), in one statement: one commit per round, however many jobs
    it carries."""
    params = {
        **limiter,
        "worker_id": worker_id,
        "claim_limit": claim_limit,
        "provider": provider,
        "model": model,
        "completions": _json(completions),
    }
    cur = await conn.execute(Q[settle_and_claim_query(limiter)], params)
    row = await cur.fetchone()
    assert row is not None
    claimed_json, completed_ids, already_completed_ids, limiter_json = row
    return SettleResult(
        completed_ids=list(completed_ids),
        already_completed_ids=list(already_completed_ids),
        claimed=_claimed_decoder.decode(claimed_json),
        limiter=_limiter_decoder.decode(limiter_json),
    )


async def job_fail_running(
    conn: Conn, *, worker_id: str, failures: Sequence[Failure], model: str = "", limited: bool = False,
) -> list[int]:
    """running -> failed for jobs this worker owns; returns those that were.
    With a rate limit configured (``limited``), the model's bucket gets back
    what the failed calls did not use."""
    params = {"worker_id": worker_id, "failures": _json(failures), "model": model, "limited": limited}
    cur = await conn.execute(Q["job_fail_running"], params)
    row = await cur.fetchone()
    assert row is not None
    return list(row[0])


async def job_heartbeat(conn: Conn, *, worker_id: str, progress: Mapping[int, int]) -> list[HeartbeatRow]:
    return await _all(
        conn,
        HeartbeatRow,
        "job_heartbeat",
        {
            "worker_id": worker_id,
            "beats": _json([{"id": job_id, "progress": tokens} for job_id, tokens in progress.items()]),
        },
    )


async def job_listen_pending(conn: Conn) -> None:
    await conn.execute(Q["job_listen_pending"])


async def job_adopt_lost_claims(conn: Conn, *, worker_id: str, known_ids: Sequence[int]) -> list[ClaimedJob]:
    return await _all(
        conn,
        ClaimedJob,
        "job_adopt_lost_claims",
        {"worker_id": worker_id, "known_ids": list(known_ids)},
    )


async def llm_call_start(
    conn: Conn, *, worker_id: str, job_id: int, previous_attempt: int, previous_outcome: LlmOutcome,
    previous_billed: bool, previous_error: str | None, model: str = "", limits: RateLimits = NO_LIMITS,
) -> RetryStart:
    """Closes the previous attempt's ledger row and, if the job is still
    running under this worker and ``model``'s rate bucket is not paused and
    holds a request (refilled at ``limits``' rates), opens the next (see
    RetryStart)."""
    started = await _one(
        conn,
        RetryStart,
        "llm_call_start",
        {
            **msgspec.structs.asdict(limits),
            "model": model,
            "worker_id": worker_id,
            "job_id": job_id,
            "previous_attempt": previous_attempt,
            "previous_outcome": previous_outcome,
            "previous_billed": previous_billed,
            "previous_error": previous_error,
        },
    )
    assert started is not None
    return started


async def llm_rate_bucket_pause(conn: Conn, *, model: str, pause_s: float, limits: RateLimits = NO_LIMITS) -> None:
    """No claim and no retry for ``model`` for pause_s (a 429's retry-after);
    at ``limits``' request rate, one request in the bucket when it ends."""
    await conn.execute(Q["llm_rate_bucket_pause"], {"model": model, "pause_s": pause_s,
                                                    "requests_rate": limits.requests_rate})


async def llm_rate_bucket_ensure(conn: Conn, *, model: str, limits: RateLimits) -> None:
    """The model's bucket, full, unless it exists."""
    await conn.execute(Q["llm_rate_bucket_ensure"], {"model": model, **msgspec.structs.asdict(limits)})


async def llm_call_finish(
    conn: Conn,
    *,
    job_id: int,
    attempt: int,
    outcome: LlmOutcome,
    billed: bool,
    input_tokens: int,
    output_tokens: int,
    cost_usd: Any,
    error_text: str | None,
    request_id: str | None = None,
) -> None:
    await conn.execute(
        Q["llm_call_finish"],
        {
            "job_id": job_id,
            "attempt": attempt,
            "outcome": outcome,
            "billed": billed,
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "cost_usd": cost_usd,
            "error_text": error_text,
            "request_id": request_id,
        },
    )


# -- sweeper -----------------------------------------------------------------------


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
) -> list[StaleJob]:
    """One batch of the sweeper's rules, and the ledger rows its jobs left
    open closed, in one transaction whose statements wait at most
    lock_timeout_s for a lock."""
    async with conn.transaction():
        await _set_lock_timeout(conn, lock_timeout_s)
        swept = await _all(
            conn,
            StaleJob,
            "job_fail_stale",
            {
                "heartbeat_timeout_s": heartbeat_timeout_s,
                "job_timeout_s": job_timeout_s,
                "pending_timeout_s": pending_timeout_s,
                "judge_running": judge_running,
                "batch_size": batch_size,
                "now": now,
            },
        )
        if swept:
            await conn.execute(Q["llm_call_close_for_swept_jobs"], {"job_ids": [job.id for job in swept]})
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


async def job_queue_gauges(conn: Conn, *, now: datetime | None = None) -> QueueGauges:
    row = await _one(conn, QueueGauges, "job_queue_gauges", {"now": now})
    assert row is not None
    return row


async def budget_days_today(conn: Conn, *, now: datetime | None = None) -> list[BudgetDay]:
    return await _all(conn, BudgetDay, "budget_days_today", {"now": now})


async def llm_rate_bucket_list(conn: Conn) -> list[RateBucketRow]:
    return await _all(conn, RateBucketRow, "llm_rate_bucket_list", {})


async def job_prune_finished(
    conn: Conn, *, retention_s: float, batch_size: int, now: datetime | None = None
) -> int:
    ids = await _scalars(
        conn, "job_prune_finished", {"retention_s": retention_s, "batch_size": batch_size, "now": now}
    )
    return len(ids)


async def budget_over_reservation_total(conn: Conn) -> Decimal:
    (total,) = await _scalars(conn, "budget_over_reservation_total")
    return Decimal(total)


# -- operators' commands ----------------------------------------------------------


async def job_list(conn: Conn, *, status: JobStatus | None, limit: int) -> list[JobListRow]:
    return await _all(conn, JobListRow, "job_list", {"status": status, "limit": limit})


async def job_get_admin(conn: Conn, *, job_id: uuid.UUID) -> JobAdminRow | None:
    return await _one(conn, JobAdminRow, "job_get_admin", {"job_id": job_id})


async def llm_call_list_for_job(conn: Conn, *, job_id: int) -> list[LlmCallRow]:
    return await _all(conn, LlmCallRow, "llm_call_list_for_job", {"job_id": job_id})


async def stats_last_hour(conn: Conn) -> HourStats:
    row = await _one(conn, HourStats, "stats_last_hour", {})
    assert row is not None
    return row


# -- operators: their keys and the console ---------------------------------------


async def operator_key_insert(conn: Conn, *, name: str, key_prefix: str, key_hash: bytes) -> None:
    await conn.execute(Q["operator_key_insert"], {"name": name, "key_prefix": key_prefix, "key_hash": key_hash})


async def operator_key_get(conn: Conn, *, key_prefix: str) -> OperatorKeyAuth | None:
    return await _one(conn, OperatorKeyAuth, "operator_key_get", {"key_prefix": key_prefix})


async def operator_key_list(conn: Conn) -> list[OperatorKeyListRow]:
    return await _all(conn, OperatorKeyListRow, "operator_key_list", {})


async def operator_key_revoke(conn: Conn, *, key_prefix: str) -> bool:
    return bool(await _scalars(conn, "operator_key_revoke", {"key_prefix": key_prefix}))


async def job_id_bounds(
    conn: Conn, *, created_after: datetime | None, created_before: datetime | None
) -> JobIdBounds:
    row = await _one(conn, JobIdBounds, "job_id_bounds",
                     {"created_after": created_after, "created_before": created_before})
    assert row is not None
    return row


def _filter_params(filters: JobFilter) -> dict[str, Any]:
    return msgspec.structs.asdict(filters)


async def ops_job_list(
    conn: Conn, *, before_id: int, floor_id: int, filters: JobFilter, limit: int
) -> list[OpsJobRow]:
    """Jobs matching filters with floor_id <= id < before_id, newest first."""
    params = {**_filter_params(filters), "before_id": before_id, "floor_id": floor_id, "limit": limit}
    return await _all(conn, OpsJobRow, "ops_job_list", params)


async def ops_job_list_live(
    conn: Conn, *, filters: JobFilter, before_created_at: datetime | None, before_id: int | None, limit: int
) -> list[OpsJobRow]:
    """Jobs of one live status (filters.status) below (before_created_at,
    before_id), newest first; None: from the newest."""
    params = {**_filter_params(filters), "before_created_at": before_created_at, "before_id": before_id,
              "limit": limit}
    return await _all(conn, OpsJobRow, "ops_job_list_live", params)


async def ops_job_get(conn: Conn, *, job_id: uuid.UUID) -> OpsJobDetail | None:
    return await _one(conn, OpsJobDetail, "ops_job_get", {"job_id": job_id})


async def ops_job_cancel(conn: Conn, *, job_id: uuid.UUID) -> CancelResult | None:
    """An operator's cancellation, whoever's the job: as job_cancel, the
    ledger row of a call left open closed in the same transaction. None: no
    such job."""
    return await _cancel(conn, "ops_job_cancel", {"job_id": job_id, "client_id": None})


async def ops_job_count_pending(conn: Conn, *, filters: JobFilter) -> PendingCount:
    # status and error_code are not read: the count is of pending jobs
    row = await _one(conn, PendingCount, "ops_job_count_pending", _filter_params(filters))
    assert row is not None
    return row


async def ops_job_cancel_pending(conn: Conn, *, filters: JobFilter, through_id: int) -> list[uuid.UUID]:
    """Cancels the pending jobs matching filters (client and time range) up
    to through_id; returns the job ids it cancelled."""
    return await _scalars(conn, "ops_job_cancel_pending", {**_filter_params(filters), "through_id": through_id})


async def ops_client_list(conn: Conn) -> list[OpsClient]:
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(Q["ops_client_list"], {})
        rows = await cur.fetchall()
    # the keys arrive as one JSON array per client
    return msgspec.convert(rows, list[OpsClient])


async def api_key_revoke_for_client(conn: Conn, *, client_id: int) -> list[str] | None:
    """Revokes the client's active keys; returns their prefixes (None: no
    such client)."""
    found = await _scalars(conn, "api_key_revoke_for_client", {"client_id": client_id})
    return list(found[0]) if found else None


async def ops_overview(conn: Conn, *, day_from_id: int) -> OpsOverviewRow:
    row = await _one(conn, OpsOverviewRow, "ops_overview", {"day_from_id": day_from_id})
    assert row is not None
    return row


# -- the console's history, kept by the sweeper ------------------------------------------


async def rollup_minutes(conn: Conn, *, from_minute: datetime, from_id: int, bounds_s: Sequence[float],
                         pending: int, running: int) -> int:
    """Recounts minute_rollup from from_minute to now; the minutes written."""
    found = await _scalars(conn, "rollup_minutes", {
        "from_minute": from_minute, "from_id": from_id, "bounds_s": [float(b) for b in bounds_s],
        "pending": pending, "running": running,
    })
    return int(found[0])


async def rollup_prune(conn: Conn) -> None:
    await conn.execute(Q["rollup_prune"])


async def ops_history(conn: Conn, *, since: datetime, step: timedelta, origin: datetime) -> list[RollupMinuteRow]:
    """The rollup from since, summed into buckets of step aligned on origin
    (each row's minute is its bucket's start)."""
    return await _all(conn, RollupMinuteRow, "ops_history", {"since": since, "step": step, "origin": origin})


async def ops_writers_recent(conn: Conn) -> list[str]:
    return [str(provider) for provider in await _scalars(conn, "ops_writers_recent")]


async def ops_client_today(conn: Conn, *, from_id: int, day_start: datetime) -> list[ClientToday]:
    return await _all(conn, ClientToday, "ops_client_today", {"from_id": from_id, "day_start": day_start})


async def ops_workers(conn: Conn) -> list[WorkerRow]:
    return await _all(conn, WorkerRow, "ops_workers", {})


# -- webhooks ----------------------------------------------------------------------


async def webhook_endpoint_insert(
    conn: Conn, *, client_id: int, url: str, events: Sequence[str], secret: str, max_per_client: int
) -> WebhookEndpointRow | None:
    """None: the client has max_per_client endpoints already."""
    return await _one(conn, WebhookEndpointRow, "webhook_endpoint_insert",
                      {"client_id": client_id, "url": url, "events": list(events), "secret": secret,
                       "max_per_client": max_per_client})


async def webhook_endpoint_list_for_client(conn: Conn, *, client_id: int) -> list[WebhookEndpointRow]:
    return await _all(conn, WebhookEndpointRow, "webhook_endpoint_list_for_client", {"client_id": client_id})


async def webhook_endpoint_delete(conn: Conn, *, client_id: int, endpoint_id: uuid.UUID) -> bool:
    return bool(await _scalars(conn, "webhook_endpoint_delete",
                               {"client_id": client_id, "endpoint_id": endpoint_id}))


async def webhook_endpoint_rotate_secret(
    conn: Conn, *, client_id: int, endpoint_id: uuid.UUID, secret: str, overlap_s: float
) -> WebhookEndpointRow | None:
    return await _one(conn, WebhookEndpointRow, "webhook_endpoint_rotate_secret",
                      {"client_id": client_id, "endpoint_id": endpoint_id, "secret": secret,
                       "overlap_s": overlap_s})


async def webhook_delivery_claim(conn: Conn, *, limit: int, lease_s: float) -> list[WebhookDeliveryClaim]:
    return await _all(conn, WebhookDeliveryClaim, "webhook_delivery_claim", {"limit": limit, "lease_s": lease_s})


async def webhook_delivery_finish(
    conn: Conn, *, delivery_id: int, attempt: int, outcome: DeliveryOutcome, retry_in_s: float = 0.0,
    status_code: int | None = None, error: str | None = None,
) -> float | None:
    """Seconds from the event to now; None: the attempt was no longer the
    delivery's (its lease ran out and it was claimed again, or its endpoint
    was deleted)."""
    found = await _scalars(conn, "webhook_delivery_finish", {
        "delivery_id": delivery_id, "attempt": attempt, "outcome": outcome, "retry_in_s": retry_in_s,
        "status_code": status_code, "error": error})
    return float(found[0]) if found else None


async def webhook_delivery_gauges(conn: Conn, *, now: datetime | None = None) -> WebhookDeliveryGauges:
    row = await _one(conn, WebhookDeliveryGauges, "webhook_delivery_gauges", {"now": now})
    assert row is not None
    return row


async def webhook_endpoint_list(conn: Conn, *, client_id: int | None = None) -> list[WebhookEndpointAdminRow]:
    return await _all(conn, WebhookEndpointAdminRow, "webhook_endpoint_list", {"client_id": client_id})


async def webhook_delivery_list(
    conn: Conn, *, endpoint_id: uuid.UUID | None = None, state: str | None = None, limit: int = 50
) -> list[WebhookDeliveryRow]:
    return await _all(conn, WebhookDeliveryRow, "webhook_delivery_list",
                      {"endpoint_id": endpoint_id, "state": state, "limit": limit})


async def webhook_delivery_retry(conn: Conn, *, delivery_id: int) -> bool:
    """dead -> pending, due now; False: no dead delivery of that id."""
    return bool(await _scalars(conn, "webhook_delivery_retry", {"delivery_id": delivery_id}))


async def operator_action_record(
    conn: Conn, *, operator_key_id: int, action: OperatorAction, touched: int, job_id: uuid.UUID | None = None,
    filter: Mapping[str, Any] | None = None,
) -> None:
    """Records an operator's action; run it in the action's transaction."""
    await conn.execute(Q["operator_action_insert"], {
        "operator_key_id": operator_key_id, "action": action, "job_id": job_id,
        "filter": None if filter is None else _json(filter), "touched": touched})


async def operator_action_list(conn: Conn, *, limit: int, before_id: int | None = None) -> list[OperatorActionRow]:
    return await _all(conn, OperatorActionRow, "operator_action_list", {"limit": limit, "before_id": before_id})
