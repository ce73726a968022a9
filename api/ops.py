"""The operators' console's JSON endpoints, under /ops/api (the page that
uses them: api/page.py, api/static/ops.*).

Access: an operator key (``storyjobs keys create NAME --operator``) as
``Authorization: Bearer``, checked against operator_keys by the Router's
guard before any handler runs, on every endpoint here. A client's key is not
in that table, so it gets the same 401 as a wrong key. The key travels in a
header, never a cookie, so a page on another site cannot make a browser send
it: no cross-site request can read these endpoints or trigger an action.
Each action is logged with the operator's name and key prefix.

History is read without an index of its own (each index on story_jobs costs
every status change a write): the jobs list walks the primary key down from
its cursor over at most SCAN_IDS ids per request, so every request costs
about the same at any depth and for any filter; a page may then hold fewer
jobs than asked, with a cursor to go on. Live statuses are read on the
live-jobs index instead. Time bounds become id bounds through
store.job_id_bounds.
"""

from __future__ import annotations

import base64
import binascii
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Annotated, Any

import msgspec
import structlog
from litestar import Request, Router, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import CacheControlHeader
from litestar.di import NamedDependency, Provide
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi.spec import OpenAPIFormat
from litestar.params import JSONBody, Parameter, PathParameter, QueryParameter

from api.auth import ApiKey, require_bearer_key, verify
from api.jobs import ApiState, database, parse_public_id
from api.ops_schemas import (
    BIGINT_MAX,
    TOKEN_PATTERN,
    BudgetToday,
    CancelPending,
    Client,
    ClientDay,
    ClientKey,
    Clients,
    History,
    HistoryBucket,
    JobCancelled,
    JobCounts,
    JobDetail,
    JobErrorDetail,
    JobPage,
    JobStory,
    JobSummary,
    JobWindows,
    KeysRevoked,
    Limiter,
    LimitKind,
    OperatorActions,
    OperatorActionView,
    Overview,
    PendingCancelled,
    PendingMatch,
    Percentiles,
    Provider,
    ProviderCounts,
    Queue,
    Spend,
    SpendCounts,
    Timeline,
    Undelivered,
    UndeliveredCounts,
    Worker,
    Workers,
)
from api.problems import FieldError, ProblemError, problem_responses
from shared import console_store as store
from shared import keys
from shared.config import ApiSettings
from shared.ratelimit import RateLimits
from shared.rows import (
    ROLLUP_BOUNDS_S,
    BudgetDay,
    JobFilter,
    OpsJobRow,
    OpsOverviewRow,
    RateBucketRow,
    RollupMinuteRow,
    WorkerRow,
)
from shared.status import ErrorCode, JobStatus

log = structlog.get_logger()

# ids the jobs list looks at per request, at most: a few milliseconds of
# Postgres on a 2-core machine whatever the filters match (make bench,
# ops_list: a filter matching nothing, 7 ms a request at p50)
SCAN_IDS = 20_000
# live jobs are few, and read on their own index
LIVE_STATUSES = (JobStatus.PENDING, JobStatus.RUNNING)
# a job finishes within PENDING_TIMEOUT_S + JOB_TIMEOUT_S of its creation, or
# the sweeper fails it at its next pass: this much later at worst, unless the
# sweeper is stopped
SWEEPER_LAG = timedelta(minutes=10)
HOUR = timedelta(hours=1)
DAY = timedelta(days=1)

_NOT_FOUND = {404: "No such job, client or key."}


class Operator:
    """Who is acting: the holder's name, the key's prefix and its id (what
    operator_actions records), never the key."""

    __slots__ = ("key_id", "key_prefix", "name")

    def __init__(self, name: str, key_prefix: str, key_id: int = 0) -> None:
        self.name = name
        self.key_prefix = key_prefix
        self.key_id = key_id

    def __repr__(self) -> str:
        return f"Operator(name={self.name!r}, key_prefix={self.key_prefix!r})"

    def log_fields(self) -> dict[str, str]:
        return {"operator": self.name, "operator_key_prefix": self.key_prefix}


async def require_operator_key(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """Guard of every /ops/api endpoint: an operator key that exists and is
    not revoked, else the same 401 as any bad key."""
    await require_bearer_key(connection, handler)
    api_key: ApiKey = connection.state.api_key
    api_state: ApiState = connection.app.state.storyjobs
    async with database(api_state) as conn:
        record = await store.operator_key_get(conn, key_prefix=api_key.prefix)
    verify(record, api_key)
    assert record is not None
    connection.state.operator = Operator(record.name, api_key.prefix, record.key_id)


async def refuse_unknown_query(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """Guard: a query parameter the endpoint does not take is a 400, so that a
    misspelt filter is refused instead of listing, or cancelling, everything."""
    taken = set(handler.parsed_fn_signature.parameters) - set(handler.resolve_dependencies())
    unknown = sorted(set(connection.query_params) - taken)
    if unknown:
        raise ProblemError(400, "Invalid request", f"unknown query parameter: {unknown[0]}",
                           errors=[FieldError(field=name, message="unknown query parameter") for name in unknown])


def provide_operator(request: Request[Any, Any, Any]) -> Operator:
    """The ``operator`` dependency: whom require_operator_key let in."""
    operator: Operator = request.state.operator
    return operator


# -- cursors ---------------------------------------------------------------------------


class Position(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Where a list goes on from (below id; below (at, id) for live lists),
    or the last id a cancel confirmed; given out as an opaque token."""

    id: Annotated[int, msgspec.Meta(ge=0, le=BIGINT_MAX)]
    at: datetime | None = None

    def token(self) -> str:
        return base64.urlsafe_b64encode(msgspec.json.encode(self)).decode().rstrip("=")

    @classmethod
    def from_token(cls, token: str, field: str) -> Position:
        """The position a token names; a 400 naming ``field`` if the api did not make it."""
        try:
            return msgspec.json.decode(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)), type=cls)
        except (binascii.Error, ValueError, msgspec.DecodeError):
            raise ProblemError(400, "Invalid request", f"{field}: not a value this api gave",
                               errors=[FieldError(field=field, message="not a value this api gave")]) from None


# -- parameters ------------------------------------------------------------------------


def _utc(moment: datetime | None) -> datetime | None:
    """A time without a zone is taken as UTC."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


StatusParam = Annotated[JobStatus | None, Parameter(description="Only jobs in this status.")]
ClientParam = Annotated[int | None, Parameter(ge=1, le=BIGINT_MAX,
                                              description="Only this client's jobs (`client_id` of /ops/api/clients).")]
ErrorParam = Annotated[ErrorCode | None, Parameter(description="Only failed jobs with this error code.")]
AfterParam = Annotated[datetime | None,
                       Parameter(description="Only jobs created at or after this time (UTC if no zone).")]
BeforeParam = Annotated[datetime | None, Parameter(description="Only jobs created before this time (UTC if no zone).")]
JobIdParam = Annotated[str, PathParameter(description="The job's job_id.", schema_extra={"format": OpenAPIFormat.UUID})]


_MICRO_USD = Decimal("0.000001")


def _usd(value: Decimal | None) -> str:
    """An amount as the ledger keeps it: six decimals."""
    return str((value if value is not None else Decimal(0)).quantize(_MICRO_USD))


# -- overview --------------------------------------------------------------------------


def _finished_since(settings: ApiSettings, window: timedelta) -> datetime:
    """The oldest creation time of a job that can have finished in the last
    ``window``."""
    longest_life = timedelta(seconds=settings.pending_timeout_s + settings.job_timeout_s) + SWEEPER_LAG
    return datetime.now(UTC) - window - longest_life


def _job_counts(completed: int, failed: int, cancelled: int) -> JobCounts:
    finished = completed + failed - cancelled
    ratio = None if finished == 0 else round((failed - cancelled) / finished, 4)
    return JobCounts(completed=completed, failed=failed, cancelled=cancelled, failure_ratio=ratio)


def _budget_today(days: list[BudgetDay], settings: ApiSettings) -> BudgetToday:
    everyone = next((day for day in days if day.client_id == 0), None)
    spent = everyone.spent_usd if everyone else Decimal(0)
    reserved = everyone.reserved_usd if everyone else Decimal(0)
    budget = settings.budget_usd_per_day
    return BudgetToday(spent_usd=_usd(spent), reserved_usd=_usd(reserved),
                       budget_usd=None if budget is None else _usd(budget),
                       left_usd=None if budget is None else _usd(max(budget - spent - reserved, Decimal(0))))


def _limiter(buckets: list[RateBucketRow], settings: ApiSettings) -> Limiter:
    limits = RateLimits.from_settings(settings)
    bucket = next((b for b in buckets if b.model == settings.llm_model), None)

    def kind(name: str) -> LimitKind | None:
        rate, capacity = limits.rate(name), getattr(limits, f"{name}_capacity")
        if rate is None or capacity is None:
            return None
        stored: float | None = None if bucket is None else getattr(bucket, name)
        since_s = 0.0 if bucket is None else bucket.since_refill_s
        available = capacity if stored is None else min(capacity, stored + rate * since_s)
        return LimitKind(available=round(available, 3), capacity=capacity, per_minute=rate * 60)

    return Limiter(model=settings.llm_model, paused_s=round(bucket.paused_s, 3) if bucket else 0.0,
                   requests=kind("requests"), input_tokens=kind("input_tokens"), output_tokens=kind("output_tokens"))


def _overview(row: OpsOverviewRow, settings: ApiSettings, budgets: list[BudgetDay],
              buckets: list[RateBucketRow], writers: list[str]) -> Overview:
    return Overview(
        writers=writers,
        generated_at=datetime.now(UTC),
        queue=Queue(pending=row.pending, running=row.running,
                    oldest_pending_age_s=round(row.oldest_pending_age_s, 3), queue_max=settings.queue_max),
        jobs=JobWindows(
            last_hour=_job_counts(row.hour_completed, row.hour_failed, row.hour_cancelled),
            last_day=_job_counts(row.day_completed, row.day_failed, row.day_cancelled),
        ),
        spend=Spend(
            last_hour=SpendCounts(usd=_usd(row.hour_spend_usd), billed_calls=row.hour_billed_calls,
                                  input_tokens=row.hour_input_tokens, output_tokens=row.hour_output_tokens),
            last_day=SpendCounts(usd=_usd(row.day_spend_usd), billed_calls=row.day_billed_calls,
                                 input_tokens=row.day_input_tokens, output_tokens=row.day_output_tokens),
            today=_budget_today(budgets, settings),
        ),
        undelivered=Undelivered(
            last_hour=UndeliveredCounts(jobs=row.hour_undelivered, usd=_usd(row.hour_undelivered_usd)),
            last_day=UndeliveredCounts(jobs=row.day_undelivered, usd=_usd(row.day_undelivered_usd)),
        ),
        provider=Provider(
            last_hour=ProviderCounts(rate_limited=row.hour_rate_limited, overloaded=row.hour_overloaded),
            last_day=ProviderCounts(rate_limited=row.day_rate_limited, overloaded=row.day_overloaded),
            limiter=_limiter(buckets, settings),
        ),
    )


@get(
    "/overview",
    summary="The queue now; jobs, spend, undelivered stories and the provider's refusals over the last hour and day",
    responses=problem_responses(400, 401, 503),
)
async def get_overview(api_state: NamedDependency[ApiState], operator: NamedDependency[Operator]) -> Overview:
    settings = api_state.settings
    async with database(api_state) as conn:
        bounds = await store.job_id_bounds(conn, created_after=_finished_since(settings, DAY), created_before=None)
        row = await store.ops_overview(conn, day_from_id=bounds.lo_id)
        budgets = await store.budget_days_today(conn)
        buckets = await store.llm_rate_bucket_list(conn)
        writers = await store.ops_writers_recent(conn)
    return _overview(row, settings, budgets, buckets, writers)


# range -> (its length, the minutes of one bucket): about a hundred bars each
# (the database sums the rollup's minutes into them, aligned on _EPOCH)
HISTORY_RANGES = {"hour": (HOUR, 1), "day": (DAY, 15), "week": (7 * DAY, 60)}
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


def _percentile(counts: list[int], share: float) -> float | None:
    """The upper bound of the bucket (ROLLUP_BOUNDS_S) holding
    the given share of the jobs counted; the last bound for the last bucket."""
    total = sum(counts)
    if not total:
        return None
    seen = 0
    for index, n in enumerate(counts):
        seen += n
        if seen >= share * total:
            return float(ROLLUP_BOUNDS_S[min(index + 1, len(ROLLUP_BOUNDS_S) - 1)])
    return float(ROLLUP_BOUNDS_S[-1])


def _add(into: list[int], counts: list[int]) -> None:
    for index, n in enumerate(counts[:len(into)]):
        into[index] += n


def _history(rows: list[RollupMinuteRow], range_: str, now: datetime) -> History:
    length, bucket_minutes = HISTORY_RANGES[range_]
    step = timedelta(minutes=bucket_minutes)
    epoch = _EPOCH
    last = epoch + (now - epoch) // step * step
    starts = [last - step * n for n in range(int(length / step) - 1, -1, -1)]
    index = {start: n for n, start in enumerate(starts)}
    sums: list[dict[str, Any]] = [
        {"completed": 0, "failed": 0, "cancelled": 0, "spend": Decimal(0), "rate_limited": 0, "pending_max": 0,
         "running_max": 0, "wait": [0] * len(ROLLUP_BOUNDS_S), "run": [0] * len(ROLLUP_BOUNDS_S)} for _ in starts]
    wait_all, run_all = [0] * len(ROLLUP_BOUNDS_S), [0] * len(ROLLUP_BOUNDS_S)
    for row in rows:
        n = index.get(epoch + (row.minute - epoch) // step * step)
        if n is None:
            continue
        bucket = sums[n]
        for name in ("completed", "failed", "cancelled", "rate_limited"):
            bucket[name] += getattr(row, name)
        bucket["spend"] += row.spend_usd
        bucket["pending_max"] = max(bucket["pending_max"], row.pending_max)
        bucket["running_max"] = max(bucket["running_max"], row.running_max)
        for name, counts, total in (("wait", row.wait_counts, wait_all), ("run", row.run_counts, run_all)):
            _add(bucket[name], counts)
            _add(total, counts)
    return History(
        range=range_, bucket_minutes=bucket_minutes,
        buckets=[HistoryBucket(
            at=start, completed=b["completed"], failed=b["failed"], cancelled=b["cancelled"], spend_usd=_usd(b["spend"]),
            rate_limited=b["rate_limited"], pending_max=b["pending_max"], running_max=b["running_max"],
            wait_p50_s=_percentile(b["wait"], 0.5), wait_p95_s=_percentile(b["wait"], 0.95),
            run_p50_s=_percentile(b["run"], 0.5), run_p95_s=_percentile(b["run"], 0.95),
        ) for start, b in zip(starts, sums, strict=True)],
        totals=Percentiles(wait_p50_s=_percentile(wait_all, 0.5), wait_p95_s=_percentile(wait_all, 0.95),
                           run_p50_s=_percentile(run_all, 0.5), run_p95_s=_percentile(run_all, 0.95)),
    )


@get(
    "/history",
    summary="Jobs finished, queue depth, wait and run time percentiles, spend and 429s over an hour, a day or a week",
    description="From the sweeper's per-minute rollup (minute_rollup), never from the jobs themselves.",
    responses=problem_responses(400, 401, 503),
)
async def get_history(
    api_state: NamedDependency[ApiState],
    operator: NamedDependency[Operator],
    # named as the query parameter: refuse_unknown_query knows parameters by their names
    range: Annotated[str, QueryParameter(pattern="^(hour|day|week)$",  # noqa: A002
                                         description="hour (1-minute bars), day (15-minute) or week (hourly).")]
    = "hour",
) -> History:
    range_ = range
    length, bucket_minutes = HISTORY_RANGES[range_]
    now = datetime.now(UTC)
    async with database(api_state) as conn:
        rows = await store.ops_history(conn, since=now - length, step=timedelta(minutes=bucket_minutes),
                                       origin=_EPOCH)
    return _history(rows, range_, now)


def _worker(row: WorkerRow, timeout_s: float) -> Worker:
    if not row.running:
        state = "idle"
    elif row.heartbeat_age_s is not None and row.heartbeat_age_s > timeout_s:
        state = "gone"
    else:
        state = "busy"
    return Worker(worker_id=row.worker_id, state=state, running=row.running, last_heartbeat_at=row.last_heartbeat_at,
                  heartbeat_age_s=None if row.heartbeat_age_s is None else round(row.heartbeat_age_s, 1),
                  last_request_at=row.last_request_at, job_ids=row.job_ids)


@get(
    "/workers",
    summary="The workers seen in the last hour: busy (from their jobs' heartbeats), gone, or idle",
    responses=problem_responses(400, 401, 503),
)
async def list_workers(api_state: NamedDependency[ApiState], operator: NamedDependency[Operator]) -> Workers:
    timeout_s = api_state.settings.heartbeat_timeout_s
    async with database(api_state) as conn:
        rows = await store.ops_workers(conn)
    return Workers(heartbeat_timeout_s=timeout_s, workers=[_worker(row, timeout_s) for row in rows])


# -- jobs ------------------------------------------------------------------------------


def _summary(row: OpsJobRow) -> JobSummary:
    return JobSummary(
        job_id=row.public_id, client_id=row.client_id, client_name=row.client_name, status=row.status,
        error_code=row.error_code, worker_id=row.worker_id, progress=row.progress, created_at=row.created_at,
        started_at=row.started_at, completed_at=row.completed_at, calls=row.calls,
        billed_calls=row.billed_calls, cost_usd=_usd(row.cost_usd),
    )


async def _live_page(conn: store.Conn, filters: JobFilter, cursor: Position | None, limit: int) -> JobPage:
    rows = await store.ops_job_list_live(
        conn, filters=filters, before_created_at=cursor.at if cursor else None,
        before_id=cursor.id if cursor else None, limit=limit + 1)
    page, more = rows[:limit], len(rows) > limit
    next_cursor = Position(id=page[-1].id, at=page[-1].created_at).token() if more else None
    return JobPage(jobs=[_summary(row) for row in page], next_cursor=next_cursor)


async def _history_page(conn: store.Conn, filters: JobFilter, cursor: Position | None, limit: int) -> JobPage:
    bounds = await store.job_id_bounds(conn, created_after=filters.created_after,
                                       created_before=filters.created_before)
    before = bounds.hi_id if cursor is None else min(cursor.id, bounds.hi_id)
    floor = max(bounds.lo_id, before - SCAN_IDS)
    if before <= floor:
        return JobPage(jobs=[], next_cursor=None)
    rows = await store.ops_job_list(conn, before_id=before, floor_id=floor, filters=filters, limit=limit)
    if len(rows) == limit:
        next_id: int | None = rows[-1].id
    else:
        # the stretch is done: go on below it, if anything is left there
        next_id = floor if floor > bounds.lo_id else None
    return JobPage(jobs=[_summary(row) for row in rows],
                   next_cursor=None if next_id is None else Position(id=next_id).token())


@get(
    "/jobs",
    summary="Jobs, newest first, filtered; paged by cursor",
    description=(
        "Each request looks at a bounded stretch of history, so a page may hold fewer jobs than `limit` (or "
        "none) while older ones still match: follow `next_cursor` until it is null. Pending and running jobs "
        "are listed from the live-jobs index, by creation time."
    ),
    responses=problem_responses(400, 401, 503),
)
async def list_jobs(
    api_state: NamedDependency[ApiState],
    operator: NamedDependency[Operator],
    status: StatusParam = None,
    client_id: ClientParam = None,
    error_code: ErrorParam = None,
    created_after: AfterParam = None,
    created_before: BeforeParam = None,
    cursor: Annotated[str | None, Parameter(description="`next_cursor` of the previous page.",
                                            pattern=TOKEN_PATTERN)] = None,
    limit: Annotated[int, Parameter(ge=1, le=200, description="Most jobs in the page.")] = 50,
) -> JobPage:
    filters = JobFilter(status=status.value if status else None, client_id=client_id,
                        error_code=error_code.value if error_code else None,
                        created_after=_utc(created_after), created_before=_utc(created_before))
    position = None if cursor is None else Position.from_token(cursor, "cursor")
    async with database(api_state) as conn:
        if status in LIVE_STATUSES:
            return await _live_page(conn, filters, position, limit)
        return await _history_page(conn, filters, position, limit)


@get(
    "/jobs/{job_id:str}",
    summary="A job: its timeline, worker, every ledger attempt, its error and its story",
    responses=problem_responses(400, 401, 404, 503, described=_NOT_FOUND),
)
async def get_job_detail(
    api_state: NamedDependency[ApiState], operator: NamedDependency[Operator], job_id: JobIdParam
) -> JobDetail:
    async with database(api_state) as conn:
        job = await store.ops_job_get(conn, job_id=parse_public_id(job_id))
        if job is None:
            raise ProblemError(404, "Not Found", "no such job")
        calls = await store.llm_call_list_for_job(conn, job_id=job.id)
    story = None
    if job.story_id is not None:
        story = JobStory(
            story_id=job.story_id, title=job.story_title or "", text=job.story_body or "",
            model=job.story_model or "", prompt_version=job.story_prompt_version or "",
            input_tokens=job.story_input_tokens or 0, output_tokens=job.story_output_tokens or 0,
            cost_usd=_usd(job.story_cost_usd), delivered=job.status == JobStatus.COMPLETED,
        )
    billed = [call for call in calls if call.billed]
    return JobDetail(
        job_id=job.public_id, client_id=job.client_id, client_name=job.client_name, status=job.status,
        error=JobErrorDetail(code=job.error_code, message=job.error_text or "") if job.error_code else None,
        worker_id=job.worker_id, progress=job.progress, request=job.request,
        timeline=Timeline(created_at=job.created_at, claimed_at=job.started_at,
                          last_heartbeat_at=job.heartbeat_at, finished_at=job.completed_at),
        calls=calls,
        billed_calls=len(billed),
        cost_usd=_usd(sum((call.cost_usd for call in billed), Decimal("0.000000"))),
        story=story,
    )


# -- actions ---------------------------------------------------------------------------


@post(
    "/jobs/{job_id:str}/cancel",
    status_code=200,
    summary="Cancel a job, pending or running, whoever's it is",
    description="It becomes failed (`cancelled`); a running job's worker closes its stream at its next heartbeat.",
    responses=problem_responses(400, 401, 404, 409, 503, described=_NOT_FOUND),
)
async def cancel_job(
    api_state: NamedDependency[ApiState], operator: NamedDependency[Operator], job_id: JobIdParam
) -> JobCancelled:
    async with database(api_state) as conn, conn.transaction():
        result = await store.ops_job_cancel(conn, job_id=parse_public_id(job_id))
        if result is not None:
            await store.operator_action_record(conn, operator_key_id=operator.key_id, action="job_cancel",
                                               job_id=parse_public_id(job_id), touched=int(result.cancelled))
    if result is None:
        raise ProblemError(404, "Not Found", "no such job")
    if not result.cancelled:
        raise ProblemError(409, "Conflict", f"the job already finished ({result.previous_status})")
    log.info("ops.job_cancelled", job_id=job_id, previous_status=result.previous_status, **operator.log_fields())
    return JobCancelled(job_id=parse_public_id(job_id), previous_status=result.previous_status, status=JobStatus.FAILED)


@get(
    "/cancel-pending",
    summary="How many pending jobs a filter matches: the confirmation before cancelling them",
    responses=problem_responses(400, 401, 503),
)
async def count_pending(
    api_state: NamedDependency[ApiState],
    operator: NamedDependency[Operator],
    client_id: ClientParam = None,
    created_after: AfterParam = None,
    created_before: BeforeParam = None,
) -> PendingMatch:
    filters = JobFilter(client_id=client_id, created_after=_utc(created_after), created_before=_utc(created_before))
    async with database(api_state) as conn:
        found = await store.ops_job_count_pending(conn, filters=filters)
    through = None if found.through_id is None else Position(id=found.through_id).token()
    return PendingMatch(pending=found.pending, through=through)


@post(
    "/cancel-pending",
    status_code=200,
    summary="Cancel the pending jobs a filter matched when they were counted",
    description=(
        "One guarded statement: every job still pending that matches the filter, up to `through` from "
        "GET /ops/api/cancel-pending, becomes failed (`cancelled`). Jobs that arrived since are left alone."
    ),
    responses=problem_responses(400, 401, 503),
)
async def cancel_pending(
    api_state: NamedDependency[ApiState], operator: NamedDependency[Operator], data: JSONBody[CancelPending]
) -> PendingCancelled:
    through = Position.from_token(data.through, "through")
    filters = JobFilter(client_id=data.client_id, created_after=_utc(data.created_after),
                        created_before=_utc(data.created_before))
    async with database(api_state) as conn, conn.transaction():
        cancelled = await store.ops_job_cancel_pending(conn, filters=filters, through_id=through.id)
        await store.operator_action_record(
            conn, operator_key_id=operator.key_id, action="pending_cancel", touched=len(cancelled),
            filter={"client_id": filters.client_id, "created_after": filters.created_after,
                    "created_before": filters.created_before, "through": data.through})
    log.info("ops.pending_cancelled", cancelled=len(cancelled), client_id=data.client_id,
             created_after=data.created_after, created_before=data.created_before, **operator.log_fields())
    return PendingCancelled(cancelled=len(cancelled), job_ids=cancelled)


@get("/clients", summary="The clients and their keys (by prefix)",
     responses=problem_responses(400, 401, 503))
async def list_clients(api_state: NamedDependency[ApiState], operator: NamedDependency[Operator]) -> Clients:
    now = datetime.now(UTC)
    day_start = now.replace(hour=0, minute=0, second=0, microsecond=0)
    async with database(api_state) as conn:
        rows = await store.ops_client_list(conn)
        bounds = await store.job_id_bounds(conn, created_after=day_start, created_before=None)
        jobs = {row.client_id: row for row in await store.ops_client_today(conn, from_id=bounds.lo_id,
                                                                           day_start=day_start)}
        spend = {day.client_id: day for day in await store.budget_days_today(conn)}
    default_budget = api_state.settings.client_budget_usd_per_day

    def today(client_id: int, own_budget: Decimal | None) -> ClientDay:
        day, counted = spend.get(client_id), jobs.get(client_id)
        budget = own_budget if own_budget is not None else default_budget
        return ClientDay(spent_usd=_usd(day.spent_usd if day else Decimal(0)),
                         reserved_usd=_usd(day.reserved_usd if day else Decimal(0)),
                         budget_usd=None if budget is None else _usd(budget),
                         jobs=counted.jobs if counted else 0, failed=counted.failed if counted else 0)

    return Clients(clients=[
        Client(client_id=row.client_id, name=row.name, created_at=row.created_at,
               keys=[ClientKey(key_prefix=key.key_prefix, created_at=key.created_at, revoked_at=key.revoked_at)
                     for key in row.keys],
               today=today(row.client_id, row.budget_usd_per_day))
        for row in rows
    ])


@post(
    "/clients/{client_id:int}/revoke-keys",
    status_code=200,
    summary="Revoke every active key of a client",
    description="Effective from each key's next request.",
    responses=problem_responses(400, 401, 404, 503, described=_NOT_FOUND),
)
async def revoke_client_keys(
    api_state: NamedDependency[ApiState],
    operator: NamedDependency[Operator],
    client_id: Annotated[int, PathParameter(ge=1, le=BIGINT_MAX, description="`client_id` of /ops/api/clients.")],
) -> KeysRevoked:
    async with database(api_state) as conn, conn.transaction():
        revoked = await store.api_key_revoke_for_client(conn, client_id=client_id)
        if revoked is not None:
            await store.operator_action_record(conn, operator_key_id=operator.key_id, action="client_keys_revoke",
                                               filter={"client_id": client_id}, touched=len(revoked))
    if revoked is None:
        raise ProblemError(404, "Not Found", "no such client")
    log.info("ops.client_keys_revoked", client_id=client_id, key_prefixes=revoked, **operator.log_fields())
    return KeysRevoked(revoked=revoked)


@post(
    "/keys/{key_prefix:str}/revoke",
    status_code=200,
    summary="Revoke one client key, by its prefix",
    description="Effective from its next request. Operators' keys are revoked with `storyjobs keys revoke`.",
    responses=problem_responses(400, 401, 404, 503, described={404: "No active client key with this prefix."}),
)
async def revoke_key(
    api_state: NamedDependency[ApiState],
    operator: NamedDependency[Operator],
    key_prefix: Annotated[str, PathParameter(description="The key's prefix, as /ops/api/clients lists it.")],
) -> KeysRevoked:
    revoked = False
    if keys.is_prefix(key_prefix):
        async with database(api_state) as conn, conn.transaction():
            revoked = await store.api_key_revoke(conn, key_prefix=key_prefix)
            if revoked:
                await store.operator_action_record(conn, operator_key_id=operator.key_id, action="key_revoke",
                                                   filter={"key_prefix": key_prefix}, touched=1)
    if not revoked:
        raise ProblemError(404, "Not Found", "no active client key with this prefix")
    log.info("ops.key_revoked", key_prefix=key_prefix, **operator.log_fields())
    return KeysRevoked(revoked=[key_prefix])


@get(
    "/actions",
    summary="What operators did, newest first: who, which action, on what, how many it changed",
    description="Written in the same transaction as each action. Page with `before_id` (the last `id` seen).",
    responses=problem_responses(400, 401, 503),
)
async def list_actions(
    api_state: NamedDependency[ApiState],
    operator: NamedDependency[Operator],
    before_id: Annotated[int | None, Parameter(ge=1, le=BIGINT_MAX, description="Only actions older than this id.")]
    = None,
    limit: Annotated[int, Parameter(ge=1, le=200, description="Most actions listed.")] = 20,
) -> OperatorActions:
    async with database(api_state) as conn:
        rows = await store.operator_action_list(conn, limit=limit, before_id=before_id)
    return OperatorActions(actions=[
        OperatorActionView(id=row.id, operator=row.operator, operator_key_prefix=row.operator_key_prefix,
                           action=row.action, job_id=row.job_id,
                           filter=None if row.filter is None else msgspec.json.decode(row.filter),
                           touched=row.touched, acted_at=row.acted_at)
        for row in rows
    ])


ROUTES = Router(
    "/ops/api",
    route_handlers=[get_overview, get_history, list_workers, list_jobs, get_job_detail, cancel_job, count_pending,
                    cancel_pending, list_clients, revoke_client_keys, revoke_key, list_actions],
    guards=[require_operator_key, refuse_unknown_query],
    dependencies={"operator": Provide(provide_operator, sync_to_thread=False)},
    tags=["ops"],
    security=[{"OperatorKey": []}],
    cache_control=CacheControlHeader(no_store=True),
)
