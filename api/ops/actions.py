"""GET /ops/api/actions: what operators did, newest first, as
operator_actions recorded it with each action."""

from __future__ import annotations

from typing import Annotated

import msgspec
from litestar import get
from litestar.di import NamedDependency
from litestar.params import Parameter

from api.ops.schemas import BIGINT_MAX, OperatorActions, OperatorActionView
from api.problems import problem_responses
from shared.console_store import ConsoleStore


@get(
    "/actions",
    summary="What operators did, newest first: who, which action, on what, how many it changed",
    description="Written in the same transaction as each action. Page with `before_id` (the last `id` seen).",
    responses=problem_responses(400, 401, 503),
)
async def list_actions(
    store: NamedDependency[ConsoleStore],
    before_id: Annotated[int | None, Parameter(ge=1, le=BIGINT_MAX, description="Only actions older than this id.")]
    = None,
    limit: Annotated[int, Parameter(ge=1, le=200, description="Most actions listed.")] = 20,
) -> OperatorActions:
    rows = await store.operator_action_list(limit=limit, before_id=before_id)
    return OperatorActions(actions=[
        OperatorActionView(id=row.id, operator=row.operator, operator_key_prefix=row.operator_key_prefix,
                           action=row.action, job_id=row.job_id,
                           filter=None if row.filter is None else msgspec.json.decode(row.filter),
                           touched=row.touched, acted_at=row.acted_at)
        for row in rows
    ])
