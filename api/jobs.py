"""A client's job endpoints, one router: the enqueue (api/enqueue.py), the
poll (api/poll.py), and here the cancellation and the read of a story.

Every client route takes its store one way, the poll's: the app's state
(``provide_api_state``) and the request's key (``request_key``), then a
connection under the request's deadline (``deadline``, then
``connection_slots.store()``), and the key checked by ``verified_client`` on
what the route's first query read of it. No Litestar dependency: a
generator dependency cost the poll 40 of its 300 us of CPU
(docs/performance.md), and the other routes keep the same shape rather than
a second. Past the deadline, or with the database unreachable, the answer is
503 with Retry-After, never a hang.
"""

from __future__ import annotations

from typing import Annotated, Any

import structlog
from litestar import Request, Response, Router, delete, get
from litestar.openapi.spec import OpenAPIFormat
from litestar.params import PathParameter

from api.auth import check_bearer_key, request_key, verified_client
from api.deps import deadline, parse_public_id, provide_api_state
from api.enqueue import generate_story
from api.options import with_options
from api.poll import JOB_ID, get_job, job_state
from api.problems import ProblemError, problem_responses
from api.schemas import JobState, Story

log = structlog.get_logger()

_NO_STORE = {"Cache-Control": "no-store"}


@delete(
    "/stories/jobs/{job_id:str}",
    status_code=200,
    summary="Cancel a job",
    description=(
        "A pending or running job becomes failed (`cancelled`); a running job's worker closes its "
        "LLM stream at its next heartbeat. A finished job answers 409."
    ),
    responses=problem_responses(400, 401, 404, 409, 503),
)
async def cancel_job(request: Request[Any, Any, Any], job_id: JOB_ID) -> Response[JobState]:
    api_state = provide_api_state(request.app.state)
    api_key = request_key(request)
    public_id = parse_public_id(job_id)
    async with deadline(api_state), api_state.connection_slots.store() as store:
        client = verified_client(await store.api_key_get(key_prefix=api_key.prefix), api_key)
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
    return Response(job_state(view.job, None, None), headers=_NO_STORE)


@get(
    "/stories/{story_id:str}",
    summary="A written story",
    responses=problem_responses(400, 401, 404, 503),
)
async def get_story(
    request: Request[Any, Any, Any],
    story_id: Annotated[str, PathParameter(description="The story_id of a completed job.",
                                           schema_extra={"format": OpenAPIFormat.UUID})],
) -> Response[Story]:
    api_state = provide_api_state(request.app.state)
    api_key = request_key(request)
    async with deadline(api_state), api_state.connection_slots.store() as store:
        view = await store.story_get_for_key(key_prefix=api_key.prefix, story_id=parse_public_id(story_id))
    verified_client(view, api_key)
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
