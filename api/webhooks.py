"""Webhook endpoints: a client registers where to be told that its jobs
ended, and the console sees every client's endpoints and deliveries.

Client routes (the client's own key, like the jobs): POST, GET and DELETE
/webhook-endpoints and POST /webhook-endpoints/{id}/rotate-secret. An
endpoint belongs to the client whose key made it: another client's id is the
same 404 as an unknown one. The signing secret (``whsec_`` + base64) is
shown once, when it is made; after a rotation the previous one signs too
(both signatures, space-separated) for ROTATION_OVERLAP_S.

The URL is checked here by the rule the worker applies at each delivery
(``shared.webhooks.check_url``): what can be known without resolving it
(https that httpx parses; no host that is an address, in any spelling the
resolver reads as one, that is not public, unless WEBHOOK_ALLOW_PRIVATE); the
worker also checks every address a name resolves to. At most
MAX_ENDPOINTS_PER_CLIENT endpoints per client, exactly, also under concurrent
registrations (ApiStore.webhook_endpoint_insert locks the client first).
Each route takes its store and checks the key as every client route does
(api/jobs.py).

The console's view of every client's endpoints and deliveries is
api/ops/webhooks.py.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec
import structlog
from litestar import Request, Response, Router, delete, get, post
from litestar.openapi.spec import OpenAPIFormat
from litestar.params import JSONBody, PathParameter

from api.auth import check_bearer_key, request_key, verified_client
from api.deps import deadline, parse_public_id, provide_api_state
from api.options import with_options
from api.problems import FieldError, ProblemError, problem_responses
from shared import webhooks
from shared.rows import WebhookEndpointRow

log = structlog.get_logger()

MAX_ENDPOINTS_PER_CLIENT = 10
ROTATION_OVERLAP_S = 24 * 3600.0

Event = Literal["job.completed", "job.failed", "job.cancelled"]
_NO_STORE = {"Cache-Control": "no-store"}
_NOT_FOUND = {404: "No such webhook endpoint for this API key."}
_ENDPOINT_ID = Annotated[str, PathParameter(description="The endpoint's id, from POST /webhook-endpoints.",
                                              schema_extra={"format": OpenAPIFormat.UUID})]


class EndpointCreate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # https, a public host (see docs/webhooks.md)
    url: Annotated[str, msgspec.Meta(min_length=1, max_length=webhooks.MAX_URL_CHARS)]
    # the events to send; none given: all of them
    events: Annotated[list[Event], msgspec.Meta(min_length=1, max_length=len(webhooks.EVENTS))] | None = None


class Endpoint(WebhookEndpointRow, frozen=True):
    """A webhook endpoint, without its secret."""

    @classmethod
    def of(cls, row: WebhookEndpointRow) -> Endpoint:
        return cls(**msgspec.structs.asdict(row))


class EndpointWithSecret(msgspec.Struct, frozen=True):
    id: uuid.UUID
    url: str
    events: list[str]
    created_at: datetime
    # shown once: store it to verify the signatures
    secret: str


class Endpoints(msgspec.Struct, frozen=True):
    endpoints: list[Endpoint]


def _with_secret(row: WebhookEndpointRow, secret: str) -> EndpointWithSecret:
    return EndpointWithSecret(id=row.id, url=row.url, events=row.events, created_at=row.created_at, secret=secret)


@post(
    "/webhook-endpoints",
    status_code=201,
    summary="Register a webhook endpoint",
    description=(
        "Deliveries are signed as Standard Webhooks specify; the `secret` is shown in this answer only. "
        "The URL must be https and reach a public address."
    ),
    responses=problem_responses(400, 401, 409, 422, 503, described={
        409: f"The client has {MAX_ENDPOINTS_PER_CLIENT} endpoints already.",
        422: "The URL is not https, or names an address that is not public; `errors` says why."}),
)
async def create_endpoint(request: Request[Any, Any, Any], data: JSONBody[EndpointCreate]) -> Response[EndpointWithSecret]:
    api_state = provide_api_state(request.app.state)
    api_key = request_key(request)
    async with deadline(api_state), api_state.connection_slots.store() as store:
        client = verified_client(await store.api_key_get(key_prefix=api_key.prefix), api_key)
        try:
            webhooks.check_url(data.url, allow_private=api_state.settings.webhook_allow_private)
        except webhooks.UnsafeUrl as exc:
            # a well-formed body whose URL may not be reached: not a malformed request
            raise ProblemError(422, "Unprocessable Content", f"url: {exc}",
                               errors=[FieldError(field="url", message=str(exc))]) from None
        events = sorted(set(data.events or webhooks.EVENTS), key=webhooks.EVENTS.index)
        secret = webhooks.new_secret()
        row = await store.webhook_endpoint_insert(client_id=client.client_id, url=data.url, events=events,
                                                  secret=secret, max_per_client=MAX_ENDPOINTS_PER_CLIENT)
    if row is None:
        raise ProblemError(409, "Conflict", f"at most {MAX_ENDPOINTS_PER_CLIENT} webhook endpoints per client")
    log.info("webhook.endpoint_created", endpoint_id=str(row.id), client_id=client.client_id,
             key_prefix=client.key_prefix)
    return Response(_with_secret(row, secret), status_code=201, headers=_NO_STORE)


@get("/webhook-endpoints", summary="The client's webhook endpoints (without their secrets)",
     responses=problem_responses(401, 503))
async def list_endpoints(request: Request[Any, Any, Any]) -> Response[Endpoints]:
    api_state = provide_api_state(request.app.state)
    api_key = request_key(request)
    async with deadline(api_state), api_state.connection_slots.store() as store:
        client = verified_client(await store.api_key_get(key_prefix=api_key.prefix), api_key)
        rows = await store.webhook_endpoint_list_for_client(client_id=client.client_id)
    return Response(Endpoints(endpoints=[Endpoint.of(row) for row in rows]), headers=_NO_STORE)


@delete("/webhook-endpoints/{endpoint_id:str}", status_code=204,
        summary="Delete a webhook endpoint and its undelivered events",
        responses=problem_responses(401, 404, 503, described=_NOT_FOUND))
async def delete_endpoint(request: Request[Any, Any, Any], endpoint_id: _ENDPOINT_ID) -> None:
    api_state = provide_api_state(request.app.state)
    api_key = request_key(request)
    async with deadline(api_state), api_state.connection_slots.store() as store:
        client = verified_client(await store.api_key_get(key_prefix=api_key.prefix), api_key)
        deleted = await store.webhook_endpoint_delete(client_id=client.client_id,
                                                      endpoint_id=parse_public_id(endpoint_id))
    if not deleted:
        raise ProblemError(404, "Not Found", "no such webhook endpoint")
    log.info("webhook.endpoint_deleted", endpoint_id=endpoint_id, client_id=client.client_id,
             key_prefix=client.key_prefix)


@post(
    "/webhook-endpoints/{endpoint_id:str}/rotate-secret",
    status_code=200,
    summary="Give a webhook endpoint a new signing secret",
    description="The new secret is shown once; the previous one keeps signing beside it for 24 hours.",
    responses=problem_responses(401, 404, 503, described=_NOT_FOUND),
)
async def rotate_secret(request: Request[Any, Any, Any], endpoint_id: _ENDPOINT_ID) -> Response[EndpointWithSecret]:
    api_state = provide_api_state(request.app.state)
    api_key = request_key(request)
    secret = webhooks.new_secret()
    async with deadline(api_state), api_state.connection_slots.store() as store:
        client = verified_client(await store.api_key_get(key_prefix=api_key.prefix), api_key)
        row = await store.webhook_endpoint_rotate_secret(client_id=client.client_id,
                                                         endpoint_id=parse_public_id(endpoint_id), secret=secret,
                                                         overlap_s=ROTATION_OVERLAP_S)
    if row is None:
        raise ProblemError(404, "Not Found", "no such webhook endpoint")
    log.info("webhook.secret_rotated", endpoint_id=endpoint_id, client_id=client.client_id,
             key_prefix=client.key_prefix)
    return Response(_with_secret(row, secret), headers=_NO_STORE)


ROUTES = Router(
    "/",
    route_handlers=with_options([create_endpoint, list_endpoints, delete_endpoint, rotate_secret]),
    before_request=check_bearer_key,
    security=[{"BearerAuth": []}],
)

