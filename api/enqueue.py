"""POST /stories/generate, the enqueue: the Idempotency-Key, the body, the
lookup of a job the key made already, the admission batch's answer (202, or
422/429 with nothing stored).

All its database work runs under one deadline, API_REQUEST_TIMEOUT_S (its
lookup and its admission batch): past it, or with the database unreachable,
the answer is 503 with Retry-After, never a hang.

POST bodies are read as JSON whatever their Content-Type says (a client that
forgets the header is not refused for it), strictly and with every field
bounded: see shared/story_request.py.
"""

from __future__ import annotations

import math
import re
import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any

import structlog
from litestar import Request, Response, post
from litestar.dto import MsgspecDTO
from litestar.openapi.spec import Example, OpenAPIType, Reference, Schema
from litestar.params import HeaderParameter, JSONBody
from litestar.typing import FieldDefinition

from api import metrics, pacing
from api.admission import admission
from api.auth import ApiKey, request_key, verified_client
from api.deps import ApiState, deadline, provide_api_state
from api.problems import FieldError, ProblemError, problem_responses
from api.rows import Admission
from api.schemas import JobAccepted
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
_RETRY_AFTER = "Retry-After"
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


def budget_retry_after(day_ends_in_s: float) -> int:
    """After a budget 429: whole seconds until the budget resets at midnight
    UTC, rounded up so that a retry never lands before it; at least 1, since 0
    would ask for a retry at once."""
    return max(1, math.ceil(day_ends_in_s))


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
    api_state = provide_api_state(request.app.state)
    async with deadline(api_state):
        return await _enqueue(api_state, request_key(request), key, data)


async def _enqueue(api_state: ApiState, api_key: ApiKey, key: str, data: StoryRequest) -> Response[JobAccepted]:
    """The POST under its deadline: the lookup, then the admission batch."""
    # The connection is given back before the admission batch takes one of
    # its own from the same pool (a request holding one while it waits for
    # another could wait on a pool it helps fill).
    async with api_state.connection_slots.store() as store:
        found = await store.job_get_by_idempotency_key_for_key(key_prefix=api_key.prefix, idempotency_key=key)
    client = verified_client(found, api_key)
    assert found is not None
    new = admission(client.client_id, key, data, api_state.settings)
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
                           headers={_RETRY_AFTER: str(budget_retry_after(result.day_ends_in_s))},
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
    log.info("job.accepted", job_id=str(result.public_id), client_id=client.client_id,
             key_prefix=api_key.prefix, prompt_chars=len(data.prompt), lane=new.lane.value)
    return _accepted(result.public_id, result.status, replayed=False, lane=new.lane, created_at=result.created_at,
                     settings=api_state.settings)
