"""The console's jobs: the list (paged, api/ops/paging.py), one job in full,
and cancelling one job or the pending jobs a filter matched. Each cancel is
recorded in operator_actions in its own transaction, and logged with the
operator's name and key prefix."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Annotated

import structlog
from litestar import get, post
from litestar.di import NamedDependency
from litestar.params import JSONBody, Parameter

from api import pacing
from api.deps import ApiState, parse_public_id
from api.ops.cursor import Position
from api.ops.guard import Operator
from api.ops.paging import LIVE_STATUSES, job_page
from api.ops.params import (
    NOT_FOUND,
    AfterParam,
    BeforeParam,
    ClientParam,
    ErrorParam,
    JobIdParam,
    StatusParam,
    utc,
)
from api.ops.schemas import (
    TOKEN_PATTERN,
    CancelPending,
    JobBatch,
    JobCancelled,
    JobDetail,
    JobErrorDetail,
    JobPage,
    JobStory,
    PendingCancelled,
    PendingMatch,
    Timeline,
    usd,
)
from api.problems import ProblemError, problem_responses
from api.schemas import JobDraft
from shared.config import ApiSettings
from shared.console_rows import JobFilter, OpsJobDetail
from shared.console_store import ConsoleStore
from shared.status import JobStatus, Lane
from shared.store import job_cancel

log = structlog.get_logger()


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
    store: NamedDependency[ConsoleStore],
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
                        created_after=utc(created_after), created_before=utc(created_before))
    position = None if cursor is None else Position.from_token(cursor, "cursor")
    return await job_page(store, filters, status in LIVE_STATUSES, position, limit)


@get(
    "/jobs/{job_id:str}",
    summary="A job: its lane, timeline, worker, every ledger attempt, its error and its story; a batch job's batch",
    responses=problem_responses(400, 401, 404, 503, described=NOT_FOUND),
)
async def get_job_detail(api_state: NamedDependency[ApiState], store: NamedDependency[ConsoleStore],
                         job_id: JobIdParam) -> JobDetail:
    job = await store.jobs.ops_job_get(job_id=parse_public_id(job_id))
    if job is None:
        raise ProblemError(404, "Not Found", "no such job")
    calls = await store.jobs.llm_call_list_for_job(job_id=job.id)
    story = None
    if job.story_id is not None:
        story = JobStory(
            story_id=job.story_id, title=job.story_title or "", text=job.story_body or "",
            model=job.story_model or "", prompt_version=job.story_prompt_version or "",
            input_tokens=job.story_input_tokens or 0, output_tokens=job.story_output_tokens or 0,
            cost_usd=usd(job.story_cost_usd), delivered=job.status == JobStatus.COMPLETED,
        )
    billed = [call for call in calls if call.billed]
    return JobDetail(
        job_id=job.public_id, client_id=job.client_id, client_name=job.client_name, status=job.status,
        lane=job.lane,
        error=JobErrorDetail(code=job.error_code, message=job.error_text or "") if job.error_code else None,
        worker_id=job.worker_id, progress=job.progress, request=job.request,
        timeline=Timeline(created_at=job.created_at, claimed_at=job.started_at,
                          last_heartbeat_at=job.heartbeat_at, finished_at=job.completed_at),
        calls=calls,
        billed_calls=len(billed),
        cost_usd=usd(sum((call.cost_usd for call in billed), Decimal("0.000000"))),
        story=story,
        batch=None if job.batch_id is None else JobBatch(
            id=job.batch_id, state=job.batch_state or "", provider_batch_id=job.batch_provider_id,
            processing_status=job.batch_processing_status, expires_at=job.batch_expires_at),
        waiting_for_batch_since=job.batch_ready_at if job.status in LIVE_STATUSES else None,
        due_by=_due_by(job, api_state.settings),
        draft=None if job.draft_text is None or job.status != JobStatus.RUNNING else JobDraft(
            text=job.draft_text, chars=job.draft_chars or 0, updated_at=job.draft_updated_at),
    )


def _due_by(job: OpsJobDetail, settings: ApiSettings) -> datetime | None:
    """A live batch job's due time, as its client's poll says it (api/jobs.py):
    its batch's expiry while it is in one, else the end of the collection it
    waits for plus a day."""
    if job.lane is not Lane.BATCH or job.status not in LIVE_STATUSES:
        return None
    if job.batch_ready_at is None and job.batch_expires_at is not None:
        return job.batch_expires_at
    return pacing.batch_due_by(settings, ready_at=job.batch_ready_at or job.created_at)


@post(
    "/jobs/{job_id:str}/cancel",
    status_code=200,
    summary="Cancel a job, pending or running, whoever's it is",
    description="It becomes failed (`cancelled`); a running job's worker closes its stream at its next heartbeat.",
    responses=problem_responses(400, 401, 404, 409, 503, described=NOT_FOUND),
)
async def cancel_job(
    store: NamedDependency[ConsoleStore], operator: NamedDependency[Operator], job_id: JobIdParam
) -> JobCancelled:
    async with store.transaction():
        # no client: an operator's cancellation, whoever's the job
        result = await job_cancel(store.conn, client_id=None, job_id=parse_public_id(job_id))
        if result is not None:
            await store.operator_action_insert(operator_key_id=operator.key_id, action="job_cancel",
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
    store: NamedDependency[ConsoleStore],
    client_id: ClientParam = None,
    created_after: AfterParam = None,
    created_before: BeforeParam = None,
) -> PendingMatch:
    filters = JobFilter(client_id=client_id, created_after=utc(created_after), created_before=utc(created_before))
    found = await store.jobs.ops_job_count_pending(filters=filters)
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
    store: NamedDependency[ConsoleStore], operator: NamedDependency[Operator], data: JSONBody[CancelPending]
) -> PendingCancelled:
    through = Position.from_token(data.through, "through")
    filters = JobFilter(client_id=data.client_id, created_after=utc(data.created_after),
                        created_before=utc(data.created_before))
    async with store.transaction():
        cancelled = await store.jobs.ops_job_cancel_pending(filters=filters, through_id=through.id)
        await store.operator_action_insert(
            operator_key_id=operator.key_id, action="pending_cancel", touched=len(cancelled),
            filter={"client_id": filters.client_id, "created_after": filters.created_after,
                    "created_before": filters.created_before, "through": data.through})
    log.info("ops.pending_cancelled", cancelled=len(cancelled), client_id=data.client_id,
             created_after=data.created_after, created_before=data.created_before, **operator.log_fields())
    return PendingCancelled(cancelled=len(cancelled), job_ids=cancelled)
