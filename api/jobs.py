"""The job endpoints: enqueue, poll, cancel, and read a story.

All database work of an answer runs under one deadline, API_REQUEST_TIMEOUT_S
(the ``store`` and ``slots`` dependencies, api/deps.py; for POST, its lookup
and its admission batch): past it, or with the database unreachable, the
answer is 503 with Retry-After, never a hang.

POST bodies are read as JSON whatever their Content-Type says (a client that
forgets the header is not refused for it), strictly and with every field
bounded: see shared/story_request.py. Ids in paths are opaque: a malformed one
is looked up like any other, so it is the same 404 as an unknown id.
"""

from __future__ import annotations

import hashlib
import math
import re
import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, cast

import structlog
from litestar import Request, Response, Router, delete, get, post
from litestar.di import NamedDependency
from litestar.dto import MsgspecDTO
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Example, OpenAPIFormat, OpenAPIType, Reference, Schema
from litestar.params import HeaderParameter, JSONBody, PathParameter, QueryParameter
from litestar.typing import FieldDefinition

from api import metrics, pacing
from api.admission import admission
from api.auth import (
    CLIENT_DEPENDENCIES,
    ClientStore,
    VerifiedClient,
    check_bearer_key,
    request_key,
    verify,
)
from api.deps import ApiState, ConnectionSlots, deadline, parse_public_id, provide_api_state
from api.options import with_options
from api.problems import FieldError, ProblemError, problem_responses
from api.rows import Admission, JobRead
from api.schemas import JobAccepted, JobDraft, JobError, JobState, Story
from api.store import ApiStore
from shared.config import ApiSettings
from shared.ratelimit import over_limit
from shared.status import JobStatus, Lane
from shared.story_request import (
    InvalidStoryRequest,
    StoryRequest,
    decode,
)

if TYPE_CHECKING:
    from litestar._openapi.schema_generation import SchemaCreator

log = structlog.get_logger()

# IETF draft-ietf-httpapi-idempotency-key-header: the value is a structured
# field string ("..."), which we also accept bare, as most clients send it.
# Either way the key is 1-255 printable ASCII characters; a bare one cannot
# start or end with a space (HTTP would strip it).
_SF_STRING = r'"((?:[ !#-\[\]-~]|\\["\\]){1,255})"'
_BARE = r"([!-~](?:[ -~]{0,253}[!-~])?)"
IDEMPOTENCY_KEY_PATTERN = f"^(?:{_SF_STRING}|{_BARE})$"
_IDEMPOTENCY_KEY = re.compile(f"{_SF_STRING}|{_BARE}")
_SF_ESCAPE = re.compile(r"\\(.)")

# RFC 9457 type of a 429 for spend, a relative reference into this api
BUDGET_EXHAUSTED = "/problems/budget-exhausted"
_NO_STORE = {"Cache-Control": "no-store"}
# the poll: a browser may keep it, but asks again every time (If-None-Match)
_REVALIDATE = {"Cache-Control": "private, no-cache"}
# a draft's text from character N: as long as a column's text can be
_SINCE_MAX = 2**31 - 1
_RETRY_AFTER = "Retry-After"
_JOB_ID = Annotated[str, PathParameter(description="The job_id from POST /stories/generate.",
                                         schema_extra={"format": OpenAPIFormat.UUID})]


class StoryRequestBody(MsgspecDTO[StoryRequest]):
    """Reads the body of POST /stories/generate with shared.story_request's
    strict decoder: a bad body is a 400 naming the field, before any query."""

    def decode_bytes(self, value: bytes) -> StoryRequest:
        try:
            return decode(value)
        except InvalidStoryRequest as exc:
            raise _invalid_body(exc.field, exc.message) from None

    @classmethod
    def create_openapi_schema(
        cls, field_definition: FieldDefinition, handler_id: str, schema_creator: SchemaCreator
    ) -> Reference | Schema:
        return schema_creator.for_field_definition(FieldDefinition.from_annotation(StoryRequest))


def _invalid_body(field: str, message: str) -> ProblemError:
    return ProblemError(400, "Invalid request", f"{field}: {message}",
                        errors=[FieldError(field=field, message=message)], reason="invalid_request")


def _idempotency_key(header: str | None) -> str:
    value = (header or "").strip(" \t")
    if not value:
        raise _invalid_key("Missing Idempotency-Key", "missing",
                           "send an Idempotency-Key header (1-255 printable ASCII characters) so that "
                           "a retried request cannot create a second job")
    match = _IDEMPOTENCY_KEY.fullmatch(value)
    if match is None:
        raise _invalid_key("Invalid Idempotency-Key", "not 1-255 printable ASCII characters",
                           "the Idempotency-Key must be 1-255 printable ASCII characters")
    quoted, bare = match.groups()
    return bare if quoted is None else _SF_ESCAPE.sub(r"\1", quoted)


def _invalid_key(title: str, message: str, detail: str) -> ProblemError:
    return ProblemError(400, title, detail, errors=[FieldError(field="Idempotency-Key", message=message)],
                        reason="invalid_request")


def _accepted(job_id: uuid.UUID, status: JobStatus, *, replayed: bool, lane: Lane, created_at: datetime | None,
              settings: ApiSettings) -> Response[JobAccepted]:
    due_by = pacing.batch_due_by(settings, ready_at=created_at) if lane is Lane.BATCH and created_at else None
    headers = {
        "Location": f"/stories/jobs/{job_id}",
        _RETRY_AFTER: str(pacing.retry_after_for(lane, settings, pacing.DEFAULT_RETRY_AFTER_S)),
        **_NO_STORE,
    }
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return Response(JobAccepted(job_id=job_id, status=status, lane=lane, due_by=due_by), status_code=202,
                    headers=headers)


def _replay(job_id: uuid.UUID, status: JobStatus, stored: bytes, requested: Admission,
            created_at: datetime | None, settings: ApiSettings) -> Response[JobAccepted]:
    if stored != requested.request_fingerprint:
        raise ProblemError(422, "Idempotency-Key reused",
                           "this Idempotency-Key was already used with a different request body",
                           reason="idempotency_mismatch")
    metrics.JOBS_REPLAYED.inc()
    # the same body, so the same lane
    return _accepted(job_id, status, replayed=True, lane=requested.lane, created_at=created_at, settings=settings)


@post(
    "/stories/generate",
    dto=StoryRequestBody,
    return_dto=None,
    status_code=202,
    summary="Start writing a story",
    description=(
        "Stores a job and answers at once; poll the `Location` it gives. The same "
        "`Idempotency-Key` with the same body answers the same job (`Idempotent-Replayed: true`), "
        "never a second job or a second bill. Unknown fields are refused (400), not ignored."
    ),
    responses=problem_responses(400, 401, 413, 422, 429, 503),
)
async def generate_story(
    request: Request[Any, Any, Any],
    api_state: NamedDependency[ApiState],
    slots: NamedDependency[ConnectionSlots],
    idempotency_key: Annotated[
        str | None,
        HeaderParameter(
            name="Idempotency-Key", required=True,
            description=("1-255 printable ASCII characters, unique per story you want: a structured-field "
                         'string ("...") or the bare characters.'),
            examples=[Example(value="0b6f3c9e-7f3a-4d3c-9c1e-5a7e2b1d9f00")],
            # documented here, checked by _idempotency_key with a message of its own
            schema_extra={"one_of": None, "type": OpenAPIType.STRING, "pattern": IDEMPOTENCY_KEY_PATTERN},
        ),
    ] = None,
    # None: an empty body (StoryRequestBody reads every other one)
    data: JSONBody[StoryRequest | None] = None,
) -> Response[JobAccepted]:
    key = _idempotency_key(idempotency_key)
    if data is None:
        raise _invalid_body("body", "a JSON object with at least a prompt is required")
    api_key = request_key(request)
    # ``slots``, not ``store``: the admission batch takes a connection of its
    # own from the same pool, so this one is given back before it (a request
    # holding one while it waits for another could wait on a pool it helps fill)
    async with slots.store() as store:
        found = await store.job_get_by_idempotency_key_for_key(key_prefix=api_key.prefix, idempotency_key=key)
    verify(found, api_key)
    assert found is not None
    new = admission(found.client_id, key, data, api_state.settings)
    if found.public_id is not None:
        assert found.status is not None and found.request_fingerprint is not None
        return _replay(found.public_id, found.status, found.request_fingerprint, new, found.created_at,
                       api_state.settings)
    if (limit := over_limit(api_state.settings, input_tokens=new.input_tokens_estimate,
                            output_tokens=new.max_tokens)) is not None:
        raise ProblemError(422, "Over the provider's rate limit",
                           f"this story alone needs more than {limit} allows a minute, so the provider "
                           "would never take it; nothing was stored (a shorter prompt or length fits)",
                           reason="over_rate_limit")
    result = await api_state.admissions.admit(new)
    if result.outcome in ("budget_exhausted", "client_budget_exhausted"):
        which = ("today's spend budget" if result.outcome == "budget_exhausted"
                 else "your spend budget for today")
        raise ProblemError(429, "Budget exhausted",
                           f"{which} has no room for this story's worst case; nothing was stored, retry "
                           "with the same key after the budget resets at midnight UTC",
                           headers={_RETRY_AFTER: str(max(1, math.ceil(result.day_ends_in_s)))},
                           reason=result.outcome, type=BUDGET_EXHAUSTED)
    if result.outcome in ("batch_queue_full", "client_batch_queue_full"):
        which = "the batch queue" if result.outcome == "batch_queue_full" else "your batch queue"
        raise ProblemError(429, "Queue full", f"{which} is full; nothing was stored, retry later with the same key",
                           headers={_RETRY_AFTER: str(math.ceil(api_state.settings.batch_collect_s))},
                           reason=result.outcome)
    if result.outcome in ("queue_full", "client_queue_full"):
        stats = await api_state.drain_stats.get()
        which = "the queue" if result.outcome == "queue_full" else "your queue"
        raise ProblemError(429, "Queue full", f"{which} is full; nothing was stored, retry later with the same key",
                           headers={_RETRY_AFTER: str(pacing.queue_full_retry_after(stats))},
                           reason=result.outcome)
    assert result.public_id is not None and result.status is not None
    if result.outcome == "existing":
        assert result.request_fingerprint is not None
        return _replay(result.public_id, result.status, result.request_fingerprint, new, result.created_at,
                       api_state.settings)
    metrics.JOBS_ACCEPTED.inc()
    log.info("job.accepted", job_id=str(result.public_id), client_id=found.client_id,
             key_prefix=api_key.prefix, prompt_chars=len(data.prompt), lane=new.lane.value)
    return _accepted(result.public_id, result.status, replayed=False, lane=new.lane, created_at=result.created_at,
                     settings=api_state.settings)


def _per_s(per_minute: int | None) -> float | None:
    return None if per_minute is None else per_minute / 60.0


def _job_state(job: JobRead, remaining_s: float | None, settings: ApiSettings | None) -> JobState:
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
    job_id: _JOB_ID,
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
        verify(view, api_key)
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
    return Response(_job_state(job, remaining, api_state.settings), headers=headers)


@delete(
    "/stories/jobs/{job_id:str}",
    status_code=200,
    summary="Cancel a job",
    description=(
        "A pending or running job becomes failed (`cancelled`); a running job's worker closes its "
        "LLM stream at its next heartbeat. A finished job answers 409."
    ),
    responses=problem_responses(400, 401, 404, 409, 503),
    dependencies=CLIENT_DEPENDENCIES,
)
async def cancel_job(
    store: NamedDependency[ClientStore], client: NamedDependency[VerifiedClient], job_id: _JOB_ID
) -> Response[JobState]:
    public_id = parse_public_id(job_id)
    result = await store.job_cancel(client_id=client.client_id, job_id=public_id)
    if result is None:
        raise ProblemError(404, "Not Found", "no such job")
    if not result.cancelled:
        raise ProblemError(409, "Conflict", f"the job already finished ({result.previous_status})")
    view = await store.job_get_for_key(key_prefix=client.key_prefix, job_id=public_id)
    assert view is not None and view.job is not None
    log.info("job.cancelled", job_id=str(public_id), previous_status=result.previous_status,
             key_prefix=client.key_prefix)
    # (a cancelled job is due no more: no settings needed for its due time)
    return Response(_job_state(view.job, None, None), headers=_NO_STORE)


@get(
    "/stories/{story_id:str}",
    summary="A written story",
    responses=problem_responses(400, 401, 404, 503),
)
async def get_story(
    request: Request[Any, Any, Any],
    store: NamedDependency[ApiStore],
    story_id: Annotated[str, PathParameter(description="The story_id of a completed job.",
                                           schema_extra={"format": OpenAPIFormat.UUID})],
) -> Response[Story]:
    api_key = request_key(request)
    view = await store.story_get_for_key(key_prefix=api_key.prefix, story_id=parse_public_id(story_id))
    verify(view, api_key)
    assert view is not None
    if view.story is None:
        raise ProblemError(404, "Not Found", "no such story")
    return Response(Story.of(view.story), headers=_NO_STORE)


# A client's routes: check_bearer_key checks the key's shape before the body
# is read, and keeps the key for each handler (request_key).
ROUTES = Router(
    "/",
    route_handlers=with_options([generate_story, get_job, cancel_job, get_story]),
    before_request=check_bearer_key,
    security=[{"BearerAuth": []}],
)
