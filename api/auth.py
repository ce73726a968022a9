"""Bearer API keys. The shape of the header is checked before the body is
read; the key itself is checked against the database in the first query on
the request's connection, so that authentication costs no extra round trip
when that query reads what the route needs (a job, a story, an idempotency
key, each for the key), and a revoked key is refused from the very next
request. Every client route checks it one way: ``verified_client`` on what
that first query read (``ApiStore.api_key_get`` where the route's own
queries do not read the key).

The check keeps the key on the request's state only, and handlers read it with
``request_key``; its repr shows the prefix, so that no log line or traceback
can carry the secret.

The client's routes run the check as a ``before_request`` hook, not a guard:
Litestar hands every guard call a copy of the route handler, which cost the
poll (GET /stories/jobs/{id}, the hottest path) a tenth of its time; the hook
runs at the same point, before the body is read."""

from __future__ import annotations

from typing import Any, Protocol

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.types import Scope

from api.problems import unauthorized
from shared import keys
from shared.rows import KeyAuth

# where the request's key is kept on its state (Litestar's ``request.state``)
_API_KEY = "api_key"


class KeyRecord(Protocol):
    @property
    def key_hash(self) -> bytes: ...

    @property
    def revoked(self) -> bool: ...


class ApiKey:
    __slots__ = ("key", "prefix")

    def __init__(self, key: str, prefix: str) -> None:
        self.key = key
        self.prefix = prefix

    def __repr__(self) -> str:
        return f"ApiKey(prefix={self.prefix!r})"


class VerifiedClient:
    """The client whose key was checked: its id, and the key's prefix (for
    logs), never the key."""

    __slots__ = ("client_id", "key_prefix")

    def __init__(self, client_id: int, key_prefix: str) -> None:
        self.client_id = client_id
        self.key_prefix = key_prefix

    def __repr__(self) -> str:
        return f"VerifiedClient(client_id={self.client_id!r}, key_prefix={self.key_prefix!r})"


def bearer_key(scope: Scope) -> ApiKey:
    """The request's ``Authorization: Bearer sj_...`` key, if well formed,
    else 401; kept on the request's state for ``request_key``. Read
    straight from the ASGI scope (header names arrive in lower case):
    Litestar's ``headers`` and ``state`` build an object each on every use,
    a twentieth of the poll's time."""
    header = next((value for name, value in scope["headers"] if name == b"authorization"), b"").decode("latin-1")
    if not header:
        raise unauthorized("send your API key as `Authorization: Bearer <key>`", invalid_key=False)
    scheme, _, key = header.partition(" ")
    key = key.strip(" \t")
    if scheme.lower() != "bearer" or not key:
        raise unauthorized("send your API key as `Authorization: Bearer <key>`", invalid_key=False)
    prefix = keys.prefix_of(key)
    if prefix is None:
        raise unauthorized("the API key is not valid")
    api_key = ApiKey(key, prefix)
    scope["state"][_API_KEY] = api_key
    return api_key


async def check_bearer_key(request: Request[Any, Any, Any]) -> None:
    """``before_request`` hook: ``bearer_key``, before the body is read."""
    bearer_key(request.scope)


def request_key(request: ASGIConnection[Any, Any, Any, Any]) -> ApiKey:
    """The key ``bearer_key`` found (on a client's route, or under the
    operators' guard). Not a dependency: one more root of the dependency
    graph would make Litestar resolve it beside ``api_state``, in an anyio
    task group per request, a fifth of a poll's time."""
    key: ApiKey = request.scope["state"][_API_KEY]
    return key


def verify(record: KeyRecord | None, api_key: ApiKey) -> None:
    """401 unless the key exists, matches in constant time and is not revoked."""
    # compared even when its prefix found no row, so that both take as long
    stored_hash = None if record is None else record.key_hash
    if not keys.matches(api_key.key, stored_hash) or record is None or record.revoked:
        raise unauthorized("the API key is not valid")


def verified_client(record: KeyAuth | None, api_key: ApiKey) -> VerifiedClient:
    """The client whose key this is, else 401 (``verify``): every client
    route calls it on what its first query read of the key."""
    verify(record, api_key)
    assert record is not None
    return VerifiedClient(record.client_id, api_key.prefix)
