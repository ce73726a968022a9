"""The console's webhooks: every client's endpoints with their last
deliveries, and sending a dead delivery again, recorded in operator_actions
(``retry_delivery``) in its own transaction (the client's own routes are
api/webhooks.py)."""

from __future__ import annotations

from typing import Annotated

import msgspec
import structlog
from litestar import get, post
from litestar.di import NamedDependency
from litestar.params import PathParameter

from api.ops.guard import Operator
from api.ops.params import ClientParam
from api.ops.schemas import BIGINT_MAX, DeliveryRetried, OpsDelivery, OpsEndpoint, OpsEndpoints
from api.problems import ProblemError, problem_responses
from shared.console_store import ConsoleStore

log = structlog.get_logger()

# deliveries shown per endpoint
LAST_DELIVERIES = 10


@get("/webhooks", summary="Webhook endpoints per client, with their last deliveries",
     responses=problem_responses(400, 401, 503))
async def ops_list_endpoints(store: NamedDependency[ConsoleStore], client_id: ClientParam = None) -> OpsEndpoints:
    rows = await store.webhooks.webhook_endpoint_list(client_id=client_id)
    found = []
    for row in rows:
        deliveries = await store.webhooks.webhook_delivery_list(endpoint_id=row.id, limit=LAST_DELIVERIES)
        found.append(OpsEndpoint(**msgspec.structs.asdict(row), last_deliveries=[
            OpsDelivery(**msgspec.structs.asdict(d)) for d in deliveries]))
    return OpsEndpoints(endpoints=found)


@post(
    "/webhooks/deliveries/{delivery_id:int}/retry",
    status_code=200,
    summary="Send a dead webhook delivery again",
    description="It becomes due now with a fresh retry schedule; its endpoint is enabled again if a 410 disabled it.",
    responses=problem_responses(400, 401, 404, 503, described={404: "No dead delivery with this id."}),
)
async def ops_retry_delivery(
    store: NamedDependency[ConsoleStore], operator: NamedDependency[Operator],
    delivery_id: Annotated[int, PathParameter(ge=1, le=BIGINT_MAX, description="A delivery's `id`.")],
) -> DeliveryRetried:
    async with store.transaction():
        job_id = await store.webhooks.webhook_delivery_retry(delivery_id=delivery_id)
        if job_id is not None:
            await store.operator_action_insert(operator_key_id=operator.key_id, action="retry_delivery",
                                               job_id=job_id, filter={"delivery_id": delivery_id}, touched=1)
    if job_id is None:
        raise ProblemError(404, "Not Found", "no dead delivery with this id")
    log.info("ops.webhook_delivery_retried", delivery_id=delivery_id, job_id=str(job_id), **operator.log_fields())
    return DeliveryRetried(id=delivery_id, state="pending")
