"""The console's clients and keys (api/ops/clients.py, the operator's key
check in api/ops/guard.py, ``storyjobs clients`` and ``storyjobs keys``): the
clients with their keys and their day, revoking a key or all of a client's,
the operators' keys. One method per query of sql/console.sql, its name the
query's. A client's weight is set by the common api_client_weight_set
(shared/store.py)."""

from __future__ import annotations

from datetime import datetime

import msgspec

from shared.console_rows import ClientToday, OperatorKeyAuth, OperatorKeyListRow, OpsClient
from shared.store import Conn, fetch_all, fetch_one, fetch_scalars


class ConsoleClients:
    """The clients' and keys' queries, on the console's connection
    (ConsoleStore.clients). Every method may raise any of
    ``shared.db.DB_ERRORS``."""

    __slots__ = ("conn",)

    def __init__(self, conn: Conn) -> None:
        self.conn = conn

    async def ops_client_list(self) -> list[OpsClient]:
        (clients,) = await fetch_scalars(self.conn, "ops_client_list")
        return msgspec.json.decode(clients, type=list[OpsClient])

    async def ops_client_today(self, *, from_id: int, day_start: datetime) -> list[ClientToday]:
        return await fetch_all(self.conn, ClientToday, "ops_client_today", {"from_id": from_id, "day_start": day_start})

    async def api_key_revoke(self, *, key_prefix: str) -> bool:
        return bool(await fetch_scalars(self.conn, "api_key_revoke", {"key_prefix": key_prefix}))

    async def api_key_revoke_for_client(self, *, client_id: int) -> list[str] | None:
        """Revokes the client's active keys; returns their prefixes (None: no
        such client)."""
        found = await fetch_scalars(self.conn, "api_key_revoke_for_client", {"client_id": client_id})
        return list(found[0]) if found else None

    async def operator_key_get(self, *, key_prefix: str) -> OperatorKeyAuth | None:
        return await fetch_one(self.conn, OperatorKeyAuth, "operator_key_get", {"key_prefix": key_prefix})

    async def operator_key_list(self) -> list[OperatorKeyListRow]:
        return await fetch_all(self.conn, OperatorKeyListRow, "operator_key_list", {})

    async def operator_key_revoke(self, *, key_prefix: str) -> bool:
        return bool(await fetch_scalars(self.conn, "operator_key_revoke", {"key_prefix": key_prefix}))
