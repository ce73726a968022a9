"""A page of the jobs list. History is read without an index of its own (each
index on story_jobs costs every status change a write): a page walks the
primary key down from its cursor over at most SCAN_IDS ids, so every request
costs about the same at any depth and for any filter, and may hold fewer jobs
than asked, with a cursor to go on. Live statuses are read on the live-jobs
index instead. Time bounds become id bounds through job_id_bounds (shared/store.py)."""

from __future__ import annotations

from api.ops.cursor import Position
from api.ops.schemas import JobPage, JobSummary, usd
from shared.console_rows import JobFilter, OpsJobRow
from shared.console_store import ConsoleStore
from shared.status import JobStatus
from shared.store import job_id_bounds

# ids the jobs list looks at per request, at most: a few milliseconds of
# Postgres on a 2-core machine whatever the filters match (make bench,
# ops_list: a filter matching nothing, 7 ms a request at p50)
SCAN_IDS = 20_000
# live jobs are few, and read on their own index
LIVE_STATUSES = (JobStatus.PENDING, JobStatus.RUNNING)


def _summary(row: OpsJobRow) -> JobSummary:
    return JobSummary(
        job_id=row.public_id, client_id=row.client_id, client_name=row.client_name, status=row.status,
        lane=row.lane, error_code=row.error_code, worker_id=row.worker_id, progress=row.progress, created_at=row.created_at,
        started_at=row.started_at, completed_at=row.completed_at, calls=row.calls,
        billed_calls=row.billed_calls, cost_usd=usd(row.cost_usd),
    )


async def job_page(store: ConsoleStore, filters: JobFilter, live: bool, cursor: Position | None, limit: int) -> JobPage:
    """The page below ``cursor``: of the live-jobs index if ``live``, else of history."""
    if live:
        return await _live_page(store, filters, cursor, limit)
    return await _history_page(store, filters, cursor, limit)


async def _live_page(store: ConsoleStore, filters: JobFilter, cursor: Position | None, limit: int) -> JobPage:
    rows = await store.jobs.ops_job_list(
        filters=filters, live=True, before_created_at=cursor.at if cursor else None,
        before_id=cursor.id if cursor else None, limit=limit + 1)
    page, more = rows[:limit], len(rows) > limit
    next_cursor = Position(id=page[-1].id, at=page[-1].created_at).token() if more else None
    return JobPage(jobs=[_summary(row) for row in page], next_cursor=next_cursor)


async def _history_page(store: ConsoleStore, filters: JobFilter, cursor: Position | None, limit: int) -> JobPage:
    bounds = await job_id_bounds(store.conn, created_after=filters.created_after,
                                 created_before=filters.created_before)
    before = bounds.hi_id if cursor is None else min(cursor.id, bounds.hi_id)
    floor = max(bounds.lo_id, before - SCAN_IDS)
    if before <= floor:
        return JobPage(jobs=[], next_cursor=None)
    rows = await store.jobs.ops_job_list(filters=filters, live=False, before_id=before, floor_id=floor, limit=limit)
    if len(rows) == limit:
        next_id: int | None = rows[-1].id
    else:
        # the stretch is done: go on below it, if anything is left there
        next_id = floor if floor > bounds.lo_id else None
    return JobPage(jobs=[_summary(row) for row in rows],
                   next_cursor=None if next_id is None else Position(id=next_id).token())
