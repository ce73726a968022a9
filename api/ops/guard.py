"""Who may call /ops/api: an operator key (``storyjobs keys create NAME
--operator``) as ``Authorization: Bearer``, checked against operator_keys
before any handler runs, on every endpoint: its shape by the Router's guard,
before the body is read; the key itself on the handler's own connection, by
the ``store`` every endpoint takes (provide_operator_store), so that the check
costs no connection of its own. A client's key is not in that table, so it
gets the same 401 as a wrong key. The key travels in a header, never a
cookie, so a page on another site cannot make a browser send it: no
cross-site request can read these endpoints or trigger an action.

Handlers that act (and log, and record in operator_actions who did) take the
operator as the ``operator`` dependency, which their store knows.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency
from litestar.handlers.base import BaseRouteHandler

from api.auth import ApiKey, bearer_key, request_key, verify
from api.deps import ApiState, deadline
from api.problems import FieldError, ProblemError
from shared.console_store import ConsoleStore
from shared.store import Conn


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


class OperatorStore(ConsoleStore):
    """The ``store`` of every /ops/api endpoint: a ConsoleStore whose
    connection checked the operator's key (provide_operator_store), and
    ``operator``, whose it is."""

    __slots__ = ("operator",)

    def __init__(self, conn: Conn, operator: Operator) -> None:
        super().__init__(conn)
        self.operator = operator


async def _checked_operator(conn: Conn, api_key: ApiKey) -> Operator:
    """The operator whose key this is, if it exists and is not revoked, else
    the same 401 as any bad key."""
    record = await ConsoleStore(conn).clients.operator_key_get(key_prefix=api_key.prefix)
    verify(record, api_key)
    assert record is not None
    return Operator(record.name, api_key.prefix, record.key_id)


async def provide_operator_store(
    request: Request[Any, Any, Any], api_state: NamedDependency[ApiState]
) -> AsyncIterator[OperatorStore]:
    """The ``store`` of every /ops/api endpoint: an OperatorStore on a
    connection under api.deps.deadline, once the operator's key is checked on
    it, else 401."""
    api_key = request_key(request)
    async with deadline(api_state), api_state.connection_slots.connection() as conn:
        yield OperatorStore(conn, await _checked_operator(conn, api_key))


def store_checks_the_key(handler: BaseRouteHandler) -> bool:
    """Whether the handler takes the ``store`` that checks the operator's key."""
    provide = handler.resolve_dependencies().get("store")
    return (provide is not None and provide.dependency is provide_operator_store
            and "store" in handler.parsed_fn_signature.parameters)


async def require_operator_key(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """Guard of every /ops/api answer: a well-formed key, else 401, before the
    body is read. The key itself is checked by the handler's ``store``; an
    answer that takes none (Litestar's OPTIONS) has it checked here, on a
    connection of its own, so that no answer under /ops/api skips the check."""
    api_key = bearer_key(connection.scope)
    if store_checks_the_key(handler):
        return
    api_state: ApiState = connection.app.state.storyjobs
    async with deadline(api_state), api_state.connection_slots.connection() as conn:
        await _checked_operator(conn, api_key)


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


def provide_operator(store: NamedDependency[OperatorStore]) -> Operator:
    """The ``operator`` dependency: whose key the endpoint's store checked."""
    return store.operator
