"""Webhook endpoints: a client registers where to be told that its jobs
ended, and the console sees every client's endpoints and deliveries.

Client routes (the client's own key, like the jobs): POST, GET and DELETE
/webhook-endpoints and POST /webhook-endpoints/{id}/rotate-secret. An
endpoint belongs to the client whose key made it: another client's id is the
same 404 as an unknown one. The signing secret (``whsec_`` + base64) is
shown once, when it is made; after a rotation the previous one signs too
(both signatures, space-separated) for ROTATION_OVERLAP_S.

The URL is checked here for what can be known without resolving it (https;
no address literal that is not public, unless WEBHOOK_ALLOW_PRIVATE); the
worker checks every address it resolves to at each delivery.

Operator routes under /ops/api/webhooks (tag ``ops``, the console's guard):
the endpoints per client with their last deliveries, and sending a dead
delivery again.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Literal

import msgspec
import structlog
from litestar import Response, Router, delete, get, post
from litestar.datastructures import CacheControlHeader
from litestar.di import NamedDependency, Provide
from litestar.openapi.spec import OpenAPIFormat
from litestar.params import JSONBody, PathParameter

from api import store as api_store
from api.auth import ApiKey, provide_api_key, require_bearer_key, verify
from api.jobs import ApiState, database, parse_public_id
from api.ops import (
    ClientParam,
    Operator,
    provide_operator,
    refuse_unknown_query,
    require_operator_key,
)
from api.ops_schemas import BIGINT_MAX
from api.problems import FieldError, ProblemError, problem_responses
from shared import console_store, store, webhooks
from shared.rows import WebhookEndpointRow

log = structlog.get_logger()

MAX_ENDPOINTS_PER_CLIENT = 10
ROTATION_OVERLAP_S = 24 * 3600.0
# deliveries shown per endpoint in the console
LAST_DELIVERIES = 10

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


class Endpoint(msgspec.Struct, frozen=True):
    id: uuid.UUID
    url: str
    events: list[str]
    created_at: datetime
    # it answered 410 Gone: nothing more is sent to it
    disabled_at: datetime | None
    # a delivery ran out of retries; cleared by the next success
    failing_since: datetime | None

    @classmethod
    def of(cls, row: WebhookEndpointRow) -> Endpoint:
        return cls(id=row.id, url=row.url, events=row.events, created_at=row.created_at,
                   disabled_at=row.disabled_at, failing_since=row.failing_since)


class EndpointWithSecret(msgspec.Struct, frozen=True):
    id: uuid.UUID
    url: str
    events: list[str]
    created_at: datetime
    # shown once: store it to verify the signatures
    secret: str


class Endpoints(msgspec.Struct, frozen=True):
    endpoints: list[Endpoint]


async def _client_id(conn: store.Conn, api_key: ApiKey) -> int:
    record = await store.api_key_get(conn, key_prefix=api_key.prefix)
    verify(record, api_key)
    assert record is not None
    return record.client_id


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
async def create_endpoint(
    api_state: NamedDependency[ApiState], api_key: NamedDependency[ApiKey], data: JSONBody[EndpointCreate]
) -> Response[EndpointWithSecret]:
    try:
        webhooks.check_url(data.url, allow_private=api_state.settings.webhook_allow_private)
    except webhooks.UnsafeUrl as exc:
        # a well-formed body whose URL may not be reached: not a malformed request
        raise ProblemError(422, "Unprocessable Content", f"url: {exc}",
                           errors=[FieldError(field="url", message=str(exc))]) from None
    events = sorted(set(data.events or webhooks.EVENTS), key=webhooks.EVENTS.index)
    secret = webhooks.new_secret()
    async with database(api_state) as conn:
        client_id = await _client_id(conn, api_key)
        row = await api_store.webhook_endpoint_insert(conn, client_id=client_id, url=data.url, events=events,
                                                  secret=secret, max_per_client=MAX_ENDPOINTS_PER_CLIENT)
    if row is None:
        raise ProblemError(409, "Conflict", f"at most {MAX_ENDPOINTS_PER_CLIENT} webhook endpoints per client")
    log.info("webhook.endpoint_created", endpoint_id=str(row.id), client_id=client_id, key_prefix=api_key.prefix)
    return Response(_with_secret(row, secret), status_code=201, headers=_NO_STORE)


@get("/webhook-endpoints", summary="The client's webhook endpoints (without their secrets)",
     responses=problem_responses(401, 503))
async def list_endpoints(api_state: NamedDependency[ApiState], api_key: NamedDependency[ApiKey]) -> Response[Endpoints]:
    async with database(api_state) as conn:
        client_id = await _client_id(conn, api_key)
        rows = await api_store.webhook_endpoint_list_for_client(conn, client_id=client_id)
    return Response(Endpoints(endpoints=[Endpoint.of(row) for row in rows]), headers=_NO_STORE)


@delete("/webhook-endpoints/{endpoint_id:str}", status_code=204,
        summary="Delete a webhook endpoint and its undelivered events",
        responses=problem_responses(401, 404, 503, described=_NOT_FOUND))
async def delete_endpoint(
    api_state: NamedDependency[ApiState], api_key: NamedDependency[ApiKey], endpoint_id: _ENDPOINT_ID
) -> None:
    async with database(api_state) as conn:
        client_id = await _client_id(conn, api_key)
        deleted = await api_store.webhook_endpoint_delete(conn, client_id=client_id,
                                                      endpoint_id=parse_public_id(endpoint_id))
    if not deleted:
        raise ProblemError(404, "Not Found", "no such webhook endpoint")
    log.info("webhook.endpoint_deleted", endpoint_id=endpoint_id, client_id=client_id, key_prefix=api_key.prefix)


@post(
    "/webhook-endpoints/{endpoint_id:str}/rotate-secret",
    status_code=200,
    summary="Give a webhook endpoint a new signing secret",
    description="The new secret is shown once; the previous one keeps signing beside it for 24 hours.",
    responses=problem_responses(401, 404, 503, described=_NOT_FOUND),
)
async def rotate_secret(
    api_state: NamedDependency[ApiState], api_key: NamedDependency[ApiKey], endpoint_id: _ENDPOINT_ID
) -> Response[EndpointWithSecret]:
    secret = webhooks.new_secret()
    async with database(api_state) as conn:
        client_id = await _client_id(conn, api_key)
        row = await api_store.webhook_endpoint_rotate_secret(conn, client_id=client_id,
                                                         endpoint_id=parse_public_id(endpoint_id), secret=secret,
                                                         overlap_s=ROTATION_OVERLAP_S)
    if row is None:
        raise ProblemError(404, "Not Found", "no such webhook endpoint")
    log.info("webhook.secret_rotated", endpoint_id=endpoint_id, client_id=client_id, key_prefix=api_key.prefix)
    return Response(_with_secret(row, secret), headers=_NO_STORE)


ROUTES = Router(
    "/",
    route_handlers=[create_endpoint, list_endpoints, delete_endpoint, rotate_secret],
    guards=[require_bearer_key],
    dependencies={"api_key": Provide(provide_api_key, sync_to_thread=False)},
    security=[{"BearerAuth": []}],
)


# -- the console ------------------------------------------------------------------------


class OpsDelivery(msgspec.Struct, frozen=True):
    id: int
    job_id: uuid.UUID
    job_status: str
    error_code: str | None
    # pending (waiting or in flight), delivered, dead
    state: str
    attempts: int
    created_at: datetime
    next_attempt_at: datetime
    last_attempt_at: datetime | None
    last_status_code: int | None
    last_error: str | None
    delivered_at: datetime | None


class OpsEndpoint(msgspec.Struct, frozen=True):
    id: uuid.UUID
    client_id: int
    client_name: str
    url: str
    events: list[str]
    created_at: datetime
    disabled_at: datetime | None
    failing_since: datetime | None
    pending: int
    dead: int
    last_deliveries: list[OpsDelivery]


class OpsEndpoints(msgspec.Struct, frozen=True):
    endpoints: list[OpsEndpoint]


class DeliveryRetried(msgspec.Struct, frozen=True):
    id: int
    state: str


@get("/webhooks", summary="Webhook endpoints per client, with their last deliveries",
     responses=problem_responses(400, 401, 503))
async def ops_list_endpoints(
    api_state: NamedDependency[ApiState], operator: NamedDependency[Operator],
    client_id: ClientParam = None,
) -> OpsEndpoints:
    async with database(api_state) as conn:
        rows = await console_store.webhook_endpoint_list(conn, client_id=client_id)
        found = []
        for row in rows:
            deliveries = await console_store.webhook_delivery_list(conn, endpoint_id=row.id, limit=LAST_DELIVERIES)
            found.append(OpsEndpoint(
                id=row.id, client_id=row.client_id, client_name=row.client_name, url=row.url, events=row.events,
                created_at=row.created_at, disabled_at=row.disabled_at, failing_since=row.failing_since,
                pending=row.pending, dead=row.dead,
                last_deliveries=[OpsDelivery(
                    id=d.id, job_id=d.job_public_id, job_status=d.job_status, error_code=d.error_code,
                    state=d.state, attempts=d.attempts, created_at=d.created_at, next_attempt_at=d.next_attempt_at,
                    last_attempt_at=d.last_attempt_at, last_status_code=d.last_status_code,
                    last_error=d.last_error, delivered_at=d.delivered_at) for d in deliveries]))
    return OpsEndpoints(endpoints=found)


@post(
    "/webhooks/deliveries/{delivery_id:int}/retry",
    status_code=200,
    summary="Send a dead webhook delivery again",
    description="It becomes due now with a fresh retry schedule; its endpoint is enabled again if a 410 disabled it.",
    responses=problem_responses(400, 401, 404, 503, described={404: "No dead delivery with this id."}),
)
async def ops_retry_delivery(
    api_state: NamedDependency[ApiState], operator: NamedDependency[Operator],
    delivery_id: Annotated[int, PathParameter(ge=1, le=BIGINT_MAX, description="A delivery's `id`.")],
) -> DeliveryRetried:
    async with database(api_state) as conn:
        retried = await console_store.webhook_delivery_retry(conn, delivery_id=delivery_id)
    if not retried:
        raise ProblemError(404, "Not Found", "no dead delivery with this id")
    log.info("ops.webhook_delivery_retried", delivery_id=delivery_id, **operator.log_fields())
    return DeliveryRetried(id=delivery_id, state="pending")


OPS_ROUTES = Router(
    "/ops/api",
    route_handlers=[ops_list_endpoints, ops_retry_delivery],
    guards=[require_operator_key, refuse_unknown_query],
    dependencies={"operator": Provide(provide_operator, sync_to_thread=False)},
    tags=["ops"],
    security=[{"OperatorKey": []}],
    cache_control=CacheControlHeader(no_store=True),
)
