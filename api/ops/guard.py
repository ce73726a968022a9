"""Who may call /ops/api: an operator key (``storyjobs keys create NAME
--operator``) as ``Authorization: Bearer``, checked against operator_keys by
the Router's guard before any handler runs, on every endpoint. A client's key
is not in that table, so it gets the same 401 as a wrong key. The key travels
in a header, never a cookie, so a page on another site cannot make a browser
send it: no cross-site request can read these endpoints or trigger an action.

Handlers that act (and log, and record in operator_actions who did) take the
operator as the ``operator`` dependency; the others need only the guard.
"""

from __future__ import annotations

from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from api.auth import bearer_key, verify
from api.deps import ApiState, deadline
from api.problems import FieldError, ProblemError
from shared import console_store as store


class Operator:
    """Who is acting: the holder's name, the key's prefix and its id (what
    operator_actions records), never the key."""

    __slots__ = ("key_id", "key_prefix", "name")

    def __init__(self, name: str, key_prefix: str, key_id: int = 0) -> None:
        self.name = name
        self.key_prefix = key_prefix
        self.key_id = key_id

    def __repr__(self) -> str:
        return f"Operator(name={self.name!r}, key_prefix={self.key_prefix!r})"

    def log_fields(self) -> dict[str, str]:
        return {"operator": self.name, "operator_key_prefix": self.key_prefix}


async def require_operator_key(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """Guard of every /ops/api endpoint: an operator key that exists and is
    not revoked, else the same 401 as any bad key."""
    api_key = bearer_key(connection.scope)
    api_state: ApiState = connection.app.state.storyjobs
    async with deadline(api_state), api_state.connection_slots.connection() as conn:
        record = await store.operator_key_get(conn, key_prefix=api_key.prefix)
    verify(record, api_key)
    assert record is not None
    connection.state.operator = Operator(record.name, api_key.prefix, record.key_id)


async def refuse_unknown_query(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """Guard: a query parameter the endpoint does not take is a 400, so that a
    misspelt filter is refused instead of listing, or cancelling, everything;
    so is one given twice, rather than one of its values silently chosen."""
    taken = set(handler.parsed_fn_signature.parameters) - set(handler.resolve_dependencies())
    unknown = sorted(set(connection.query_params) - taken)
    if unknown:
        raise ProblemError(400, "Invalid request", f"unknown query parameter: {unknown[0]}",
                           errors=[FieldError(field=name, message="unknown query parameter") for name in unknown])
    repeated = sorted(name for name in connection.query_params if len(connection.query_params.getall(name)) > 1)
    if repeated:
        raise ProblemError(400, "Invalid request", f"query parameter given more than once: {repeated[0]}",
                           errors=[FieldError(field=name, message="given more than once") for name in repeated])


def provide_operator(request: Request[Any, Any, Any]) -> Operator:
    """The ``operator`` dependency: whom require_operator_key let in."""
    operator: Operator = request.state.operator
    return operator
