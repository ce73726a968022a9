"""The job endpoints: enqueue, poll, cancel, and read a story."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

import structlog
from litestar import Request, Response, delete, get, post
from litestar.openapi.spec import Example
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import HeaderParameter, JSONBody, PathParameter
from psycopg_pool import AsyncConnectionPool

from api import metrics, pacing
from api.auth import api_key_of, require_bearer_key, verify
from api.problems import Problem, ProblemError
from api.schemas import JobAccepted, JobError, JobState, Story, StoryDocument
from shared import store
from shared.config import ApiSettings
from shared.rows import JobView
from shared.story_request import StoryRequest, canonical_json, fingerprint

log = structlog.get_logger()

# IETF draft-ietf-httpapi-idempotency-key-header: an sf-string, which we also
# accept unquoted (as most clients send it); 1-255 printable ASCII characters.
_IDEMPOTENCY_KEY = re.compile(r'^"?([\x20-\x7e]{1,255})"?$')
_NO_SUCH_ID = uuid.UUID(int=0)
_NO_STORE = {"Cache-Control": "no-store"}


@dataclass(frozen=True)
class ApiState:
    settings: ApiSettings
    pool: AsyncConnectionPool
    drain_stats: pacing.DrainStatsCache


def _state(request: Request[Any, Any, Any]) -> ApiState:
    state: ApiState = request.app.state.storyjobs
    return state


def _problems(*statuses: int) -> dict[int, ResponseSpec]:
    descriptions = {
        400: "The request is malformed; `errors` names the fields.",
        401: "No API key, or an invalid or revoked one.",
        404: "No such job or story for this API key.",
        409: "The job has already finished.",
        413: "The body is larger than allowed.",
        422: "This Idempotency-Key was used with a different body.",
        429: "A queue is full; nothing was stored. Retry later (Retry-After).",
        503: "The job store is unreachable. Retry later (Retry-After).",
    }
    return {
        status: ResponseSpec(data_container=Problem, media_type="application/problem+json",
                             description=descriptions[status], generate_examples=False)
        for status in statuses
    }


def _idempotency_key(header: str | None) -> str:
    if header is None:
        raise ProblemError(400, "Missing Idempotency-Key",
                           "send an Idempotency-Key header (1-255 printable ASCII characters) so that "
                           "a retried request cannot create a second job", reason="invalid_request")
    match = _IDEMPOTENCY_KEY.match(header)
    if match is None or not match.group(1).strip():
        raise ProblemError(400, "Invalid Idempotency-Key",
                           "the Idempotency-Key must be 1-255 printable ASCII characters",
                           reason="invalid_request")
    return match.group(1)


def _job_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        # looked up anyway, so a malformed id is the same 404 as an unknown one
        return _NO_SUCH_ID


def _accepted(job_id: uuid.UUID, status: str, *, replayed: bool) -> Response[JobAccepted]:
    headers = {
        "Location": f"/stories/jobs/{job_id}",
        "Retry-After": str(pacing.DEFAULT_RETRY_AFTER_S),
        **_NO_STORE,
    }
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return Response(JobAccepted(job_id=job_id, status=status), status_code=202, headers=headers)  # type: ignore[arg-type]


def _replay(job_id: uuid.UUID, status: str, stored: bytes, requested: bytes) -> Response[JobAccepted]:
    if stored != requested:
        raise ProblemError(422, "Idempotency-Key reused",
                           "this Idempotency-Key was already used with a different request body",
                           reason="idempotency_mismatch")
    metrics.JOBS_REPLAYED.inc()
    return _accepted(job_id, status, replayed=True)


@post(
    "/stories/generate",
    guards=[require_bearer_key],
    status_code=202,
    summary="Start writing a story",
    description=(
        "Stores a job and answers at once; poll the `Location` it gives. The same "
        "`Idempotency-Key` with the same body answers the same job (`Idempotent-Replayed: true`), "
        "never a second job or a second bill."
    ),
    response_headers=[],
    responses=_problems(400, 401, 413, 422, 429, 503),
    security=[{"BearerAuth": []}],
)
async def generate_story(
    request: Request[Any, Any, Any],
    data: JSONBody[StoryRequest],
    idempotency_key: Annotated[
        str | None,
        HeaderParameter(name="Idempotency-Key", required=True, min_length=1, max_length=257,
                  description="1-255 printable ASCII characters, unique per story you want.",
                  examples=[Example(value="0b6f3c9e-7f3a-4d3c-9c1e-5a7e2b1d9f00")]),
    ] = None,
) -> Response[JobAccepted]:
    state = _state(request)
    api_key = api_key_of(request)
    key = _idempotency_key(idempotency_key)
    requested = fingerprint(data)
    async with state.pool.connection() as conn:
        found = await store.job_get_by_idempotency_key_for_key(
            conn, key_prefix=api_key.prefix, idempotency_key=key
        )
        verify(found, api_key)
        assert found is not None
        if found.public_id is not None:
            assert found.status is not None and found.request_fingerprint is not None
            return _replay(found.public_id, found.status, found.request_fingerprint, requested)
        result = await store.job_insert_if_admitted(
            conn,
            client_id=found.client_id,
            idempotency_key=key,
            request_fingerprint=requested,
            request_json=canonical_json(data).decode(),
            queue_max=state.settings.queue_max,
            client_queue_max=state.settings.effective_client_queue_max,
        )
    if result.outcome in ("queue_full", "client_queue_full"):
        stats = await state.drain_stats.get()
        which = "the queue" if result.outcome == "queue_full" else "your queue"
        raise ProblemError(429, "Queue full", f"{which} is full; nothing was stored, retry later with the same key",
                           headers={"Retry-After": str(pacing.queue_full_retry_after(stats))},
                           reason=result.outcome)
    assert result.public_id is not None and result.status is not None
    if result.outcome == "existing":
        assert result.request_fingerprint is not None
        return _replay(result.public_id, result.status, result.request_fingerprint, requested)
    metrics.JOBS_ACCEPTED.inc()
    log.info("job.accepted", job_id=str(result.public_id), client_id=found.client_id,
             key_prefix=api_key.prefix, prompt_chars=len(data.prompt))
    return _accepted(result.public_id, result.status, replayed=False)


def _job_state(view: JobView, remaining_s: float | None) -> JobState:
    assert view.public_id is not None and view.status is not None and view.created_at is not None
    story = None
    if view.status == "completed" and view.story_id is not None:
        story = Story(
            story_id=view.story_id,
            title=view.story_title or "",
            text=view.story_body or "",
            model=view.story_model or "",
            input_tokens=view.story_input_tokens or 0,
            output_tokens=view.story_output_tokens or 0,
            cost_usd=str(view.story_cost_usd),
        )
    return JobState(
        job_id=view.public_id,
        status=view.status,  # type: ignore[arg-type]
        created_at=view.created_at,
        started_at=view.started_at,
        completed_at=view.completed_at,
        queue_position=view.queue_position if view.status == "pending" else None,
        progress=view.progress if view.status == "running" else None,
        estimated_seconds_remaining=None if remaining_s is None else round(remaining_s, 1),
        story=story,
        story_url=f"/stories/{view.story_id}" if story is not None else None,
        error=JobError(code=view.error_code or "unknown", message=view.error_text or "")
        if view.status == "failed" else None,
    )


@get(
    "/stories/jobs/{job_id:str}",
    guards=[require_bearer_key],
    summary="Where a job stands",
    description="`Retry-After` says when polling again is worth it, while the job is not finished.",
    responses=_problems(401, 404, 503),
    security=[{"BearerAuth": []}],
)
async def get_job(
    request: Request[Any, Any, Any],
    job_id: Annotated[str, PathParameter(description="The job_id from POST /stories/generate.")],
) -> Response[JobState]:
    state = _state(request)
    api_key = api_key_of(request)
    async with state.pool.connection() as conn:
        view = await store.job_get_for_key(conn, key_prefix=api_key.prefix, job_id=_job_id(job_id))
    verify(view, api_key)
    assert view is not None
    if view.public_id is None:
        raise ProblemError(404, "Not Found", "no such job")
    headers = dict(_NO_STORE)
    remaining = None
    if view.status in ("pending", "running"):
        stats = await state.drain_stats.get()
        remaining = pacing.seconds_remaining(
            stats, status=view.status, queue_position=view.queue_position,
            started_at=view.started_at, progress=view.progress, now=datetime.now(UTC),
        )
        headers["Retry-After"] = str(pacing.retry_after(view.status, remaining))
    return Response(_job_state(view, remaining), headers=headers)


@delete(
    "/stories/jobs/{job_id:str}",
    guards=[require_bearer_key],
    status_code=200,
    summary="Cancel a job",
    description=(
        "A pending or running job becomes failed (`cancelled`); a running job's worker closes its "
        "LLM stream at its next heartbeat. A finished job answers 409."
    ),
    responses=_problems(401, 404, 409, 503),
    security=[{"BearerAuth": []}],
)
async def cancel_job(
    request: Request[Any, Any, Any],
    job_id: Annotated[str, PathParameter(description="The job_id from POST /stories/generate.")],
) -> Response[JobState]:
    state = _state(request)
    api_key = api_key_of(request)
    public_id = _job_id(job_id)
    async with state.pool.connection() as conn:
        record = await store.api_key_get(conn, key_prefix=api_key.prefix)
        verify(record, api_key)
        assert record is not None
        result = await store.job_cancel(conn, client_id=record.client_id, job_id=public_id)
        if result is None:
            raise ProblemError(404, "Not Found", "no such job")
        if not result.cancelled:
            raise ProblemError(409, "Conflict", f"the job already finished ({result.previous_status})")
        view = await store.job_get_for_key(conn, key_prefix=api_key.prefix, job_id=public_id)
    assert view is not None
    log.info("job.cancelled", job_id=str(public_id), previous_status=result.previous_status,
             key_prefix=api_key.prefix)
    return Response(_job_state(view, None), headers=_NO_STORE)


@get(
    "/stories/{story_id:str}",
    guards=[require_bearer_key],
    summary="A written story",
    responses=_problems(401, 404, 503),
    security=[{"BearerAuth": []}],
)
async def get_story(
    request: Request[Any, Any, Any],
    story_id: Annotated[str, PathParameter(description="The story_id of a completed job.")],
) -> Response[StoryDocument]:
    state = _state(request)
    api_key = api_key_of(request)
    async with state.pool.connection() as conn:
        view = await store.story_get_for_key(conn, key_prefix=api_key.prefix, story_id=_job_id(story_id))
    verify(view, api_key)
    assert view is not None
    if view.story_id is None or view.job_id is None:
        raise ProblemError(404, "Not Found", "no such story")
    document = StoryDocument(
        story_id=view.story_id,
        job_id=view.job_id,
        title=view.title or "",
        text=view.body or "",
        model=view.model or "",
        prompt_version=view.prompt_version or "",
        input_tokens=view.input_tokens or 0,
        output_tokens=view.output_tokens or 0,
        cost_usd=str(view.cost_usd),
        created_at=view.created_at or datetime.now(UTC),
    )
    return Response(document, headers=_NO_STORE)


ROUTES = [generate_story, get_job, cancel_job, get_story]
