"""GET /stories/jobs/{job_id}, the poll, the hottest path: where a job
stands (its queue position, progress, draft, story or error), its ETag and
304, and when polling again is worth it (Retry-After); and ``job_state``, a
job as every job answer shows it.

The poll takes no dependency (see ``get_job``); its database work runs under
the request's deadline, API_REQUEST_TIMEOUT_S: past it, or with the database
unreachable, the answer is 503 with Retry-After, never a hang. Ids in paths
are opaque: a malformed one is looked up like any other, so it is the same
404 as an unknown id.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Annotated, Any, cast

from litestar import Request, Response, get
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import OpenAPIFormat
from litestar.params import HeaderParameter, PathParameter, QueryParameter

from api import pacing
from api.auth import request_key, verified_client
from api.deps import deadline, parse_public_id, provide_api_state
from api.problems import ProblemError, problem_responses
from api.rows import JobRead
from api.schemas import JobDraft, JobError, JobState, Story
from shared.config import ApiSettings
from shared.status import JobStatus, Lane

# the poll: a browser may keep it, but asks again every time (If-None-Match)
_REVALIDATE = {"Cache-Control": "private, no-cache"}
# a draft's text from character N: as long as a column's text can be
_SINCE_MAX = 2**31 - 1
_RETRY_AFTER = "Retry-After"
JOB_ID = Annotated[str, PathParameter(description="The job_id from POST /stories/generate.",
                                        schema_extra={"format": OpenAPIFormat.UUID})]


def _per_s(per_minute: int | None) -> float | None:
    return None if per_minute is None else per_minute / 60.0


def job_state(job: JobRead, remaining_s: float | None, settings: ApiSettings | None) -> JobState:
    fraction = pacing.fraction_done(job.progress, job.max_tokens)
    story = Story.of(job.story) if job.status is JobStatus.COMPLETED and job.story is not None else None
    return JobState(
        job_id=job.public_id,
        status=job.status,
        created_at=job.created_at,
        started_at=job.started_at,
        completed_at=job.completed_at,
        queue_position=job.queue_position if job.status is JobStatus.PENDING else None,
        progress=job.progress if job.status is JobStatus.RUNNING else None,
        percent_done=pacing.percent_done(job.status, fraction),
        estimated_seconds_remaining=None if remaining_s is None else round(remaining_s, 1),
        story=story,
        story_url=f"/stories/{story.story_id}" if story is not None else None,
        error=JobError(code=job.error_code or "unknown", message=job.error_text or "")
        if job.status is JobStatus.FAILED else None,
        lane=job.lane,
        due_by=_due_by(job, settings),
        draft=None if job.draft is None or job.status is not JobStatus.RUNNING
        else JobDraft(text=job.draft.text, chars=job.draft.chars, updated_at=job.draft.updated_at),
    )


def etag_of(job: JobRead) -> str:
    """A weak ETag over what a client shows of the job: its status, queue
    position, progress, the draft's length, the story or the error, the due
    time. Not the time-remaining estimate, which moves with every job that
    finishes and which a poll may show one poll stale; not ``since``, which
    only cuts what is sent of a draft of the same length."""
    shown = "|".join(str(part) for part in (
        job.status.value, job.queue_position if job.status is JobStatus.PENDING else "",
        job.progress if job.status is JobStatus.RUNNING else "",
        job.draft.chars if job.draft is not None and job.status is JobStatus.RUNNING else "",
        job.story.story_id if job.story is not None else "", job.error_code or "", job.batch_ready_at or "",
        job.batch_expires_at or ""))
    return f'W/"{hashlib.blake2b(shown.encode(), digest_size=12).hexdigest()}"'


def _not_modified(if_none_match: str | None, etag: str) -> bool:
    """Whether If-None-Match names ``etag`` (compared weakly, as RFC 9110
    asks for If-None-Match) or is ``*``."""
    if not if_none_match:
        return False
    ours = etag.removeprefix("W/")
    for tag in if_none_match.split(","):
        tag = tag.strip()
        if tag == "*" or tag.removeprefix("W/") == ours:
            return True
    return False


def _poll_retry_after(job: JobRead, settings: ApiSettings, seconds: int) -> int:
    """A running interactive job's Retry-After, while drafts are on: at
    most two draft intervals (at least a second), so that its words flow
    rather than arrive in bursts."""
    if job.status is JobStatus.RUNNING and job.lane is Lane.INTERACTIVE and settings.draft_interval_s > 0:
        return min(seconds, max(1, int(2 * settings.draft_interval_s)))
    return seconds


def _due_by(job: JobRead, settings: ApiSettings | None) -> datetime | None:
    """A live batch job's due time: its batch's expiry once sent, else the
    end of the collection it waits for plus a day."""
    if job.lane is not Lane.BATCH or job.status not in (JobStatus.PENDING, JobStatus.RUNNING) or settings is None:
        return None
    if job.batch_expires_at is not None:
        return job.batch_expires_at
    return pacing.batch_due_by(settings, ready_at=job.batch_ready_at or job.created_at)


@get(
    "/stories/jobs/{job_id:str}",
    summary="Where a job stands",
    description=(
        "`Retry-After` says when polling again is worth it, while the job is not finished. A running job "
        "carries its `draft`, the story as it is written so far; `?since=N` sends only its text after "
        "character N (the `chars` of the previous poll), so that each word is downloaded once. Every answer "
        "has an `ETag` over what a client shows (not the time estimate): send it back in `If-None-Match` and "
        "the answer is `304 Not Modified`, without a body, while nothing shown changed."
    ),
    responses={
        304: ResponseSpec(None, description="Nothing a client shows changed since the ETag in If-None-Match."),
        **problem_responses(400, 401, 404, 503),
    },
)
async def get_job(
    request: Request[Any, Any, Any],
    job_id: JOB_ID,
    since: Annotated[int, QueryParameter(
        ge=0, le=_SINCE_MAX,
        description="Send a running job's draft text after this character (Unicode code points) only.")] = 0,
    if_none_match: Annotated[str | None, HeaderParameter(
        name="If-None-Match", required=False,
        description="The ETag of an earlier answer: 304 while nothing a client shows changed.")] = None,
) -> Response[JobState]:
    # The hottest path takes no dependency: it takes its store itself, under
    # the same deadline (api.deps.deadline), since Litestar's generator
    # dependency and the copy of the app's state it resolves cost 40 of the
    # 300 us of CPU a poll took (measured in-process, min of 30 x 500 polls).
    api_state = provide_api_state(request.app.state)
    api_key = request_key(request)
    # The connection is held for the one statement only: under load every
    # poll waits for one, and each moment a poll holds it longer is paid by
    # the polls queued behind it.
    async with deadline(api_state):
        async with api_state.connection_slots.store() as store:
            view = await store.job_get_for_key(key_prefix=api_key.prefix, job_id=parse_public_id(job_id),
                                               since=since)
        verified_client(view, api_key)
        assert view is not None
        job = view.job
        if job is None:
            raise ProblemError(404, "Not Found", "no such job")
        stats = (await api_state.drain_stats.get()
                 if job.status in (JobStatus.PENDING, JobStatus.RUNNING) else None)
    etag = etag_of(job)
    headers = {**_REVALIDATE, "ETag": etag}
    remaining = None
    if job.status in (JobStatus.PENDING, JobStatus.RUNNING):
        if job.lane is Lane.INTERACTIVE:
            remaining = pacing.seconds_remaining(
                stats, status=job.status, queue_position=job.queue_position, started_at=job.started_at,
                fraction=pacing.fraction_done(job.progress, job.max_tokens), now=job.now,
                requests_per_s=_per_s(api_state.settings.llm_requests_per_minute),
            )
        headers[_RETRY_AFTER] = str(_poll_retry_after(job, api_state.settings, pacing.retry_after_for(
            job.lane, api_state.settings, pacing.retry_after(job.status, remaining))))
    if _not_modified(if_none_match, etag):
        # no body: the answer the client holds stands (documented as 304 beside the 200's JobState)
        return cast("Response[JobState]", Response(content=b"", status_code=304, headers=headers))
    return Response(job_state(job, remaining, api_state.settings), headers=headers)
