"""The console's clients: each with its keys (by prefix), its weight, and
today's jobs and spend; revoking a client's keys, or one key; setting a
client's weight. Each action is recorded in operator_actions in its own
transaction, and logged with the operator's name and key prefix."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated

import structlog
from litestar import get, post, put
from litestar.di import NamedDependency
from litestar.params import JSONBody, PathParameter

from api.deps import ApiState
from api.ops.guard import Operator
from api.ops.params import NOT_FOUND, ClientIdPath
from api.ops.schemas import (
    Client,
    ClientDay,
    Clients,
    ClientWeight,
    KeysRevoked,
    usd,
)
from api.problems import ProblemError, problem_responses
from shared import keys
from shared.console_store import ConsoleStore
from shared.store import api_client_weight_set, budget_days_today, job_id_bounds

log = structlog.get_logger()


@get("/clients", summary="The clients and their keys (by prefix)",
     responses=problem_responses(400, 401, 503))
async def list_clients(api_state: NamedDependency[ApiState], store: NamedDependency[ConsoleStore]) -> Clients:
    now = datetime.now(UTC)
    day_start = now.replace(hour=0, minute=0, second=0, microsecond=0)
    rows = await store.clients.ops_client_list()
    bounds = await job_id_bounds(store.conn, created_after=day_start, created_before=None)
    jobs = {row.client_id: row for row in await store.clients.ops_client_today(from_id=bounds.lo_id,
                                                                               day_start=day_start)}
    spend = {day.client_id: day for day in await budget_days_today(store.conn)}
    default_budget = api_state.settings.client_budget_usd_per_day

    def today(client_id: int, own_budget: Decimal | None) -> ClientDay:
        day, counted = spend.get(client_id), jobs.get(client_id)
        budget = own_budget if own_budget is not None else default_budget
        return ClientDay(spent_usd=usd(day.spent_usd if day else Decimal(0)),
                         reserved_usd=usd(day.reserved_usd if day else Decimal(0)),
                         budget_usd=None if budget is None else usd(budget),
                         jobs=counted.jobs if counted else 0, failed=counted.failed if counted else 0)

    return Clients(clients=[
        Client(client_id=row.client_id, name=row.name, created_at=row.created_at,
               keys=row.keys,
               today=today(row.client_id, row.budget_usd_per_day), weight=row.weight)
        for row in rows
    ])


@post(
    "/clients/{client_id:int}/revoke-keys",
    status_code=200,
    summary="Revoke every active key of a client",
    description="Effective from each key's next request.",
    responses=problem_responses(400, 401, 404, 503, described=NOT_FOUND),
)
async def revoke_client_keys(
    store: NamedDependency[ConsoleStore],
    operator: NamedDependency[Operator],
    client_id: ClientIdPath,
) -> KeysRevoked:
    async with store.transaction():
        revoked = await store.clients.api_key_revoke_for_client(client_id=client_id)
        if revoked is not None:
            await store.operator_action_insert(operator_key_id=operator.key_id, action="client_keys_revoke",
                                               filter={"client_id": client_id}, touched=len(revoked))
    if revoked is None:
        raise ProblemError(404, "Not Found", "no such client")
    log.info("ops.client_keys_revoked", client_id=client_id, key_prefixes=revoked, **operator.log_fields())
    return KeysRevoked(revoked=revoked)


@put(
    "/clients/{client_id:int}/weight",
    summary="Set a client's weight: its share of the workers",
    description="Taken by the jobs the client sends from now on; its jobs already pending keep their turns.",
    responses=problem_responses(400, 401, 404, 503, described=NOT_FOUND),
)
async def set_client_weight(
    store: NamedDependency[ConsoleStore],
    operator: NamedDependency[Operator],
    client_id: ClientIdPath,
    data: JSONBody[ClientWeight],
) -> ClientWeight:
    async with store.transaction():
        found = await api_client_weight_set(store.conn, client_id=client_id, weight=data.weight)
        if found:
            await store.operator_action_insert(operator_key_id=operator.key_id, action="client_weight_set",
                                               filter={"client_id": client_id, "weight": data.weight}, touched=1)
    if not found:
        raise ProblemError(404, "Not Found", "no such client")
    log.info("ops.client_weight_set", client_id=client_id, weight=data.weight, **operator.log_fields())
    return data


@post(
    "/keys/{key_prefix:str}/revoke",
    status_code=200,
    summary="Revoke one client key, by its prefix",
    description="Effective from its next request. Operators' keys are revoked with `storyjobs keys revoke`.",
    responses=problem_responses(400, 401, 404, 503, described={404: "No active client key with this prefix."}),
)
async def revoke_key(
    store: NamedDependency[ConsoleStore],
    operator: NamedDependency[Operator],
    key_prefix: Annotated[str, PathParameter(description="The key's prefix, as /ops/api/clients lists it.")],
) -> KeysRevoked:
    revoked = False
    if keys.is_prefix(key_prefix):
        async with store.transaction():
            revoked = await store.clients.api_key_revoke(key_prefix=key_prefix)
            if revoked:
                await store.operator_action_insert(operator_key_id=operator.key_id, action="key_revoke",
                                                   filter={"key_prefix": key_prefix}, touched=1)
    if not revoked:
        raise ProblemError(404, "Not Found", "no active client key with this prefix")
    log.info("ops.key_revoked", key_prefix=key_prefix, **operator.log_fields())
    return KeysRevoked(revoked=[key_prefix])
