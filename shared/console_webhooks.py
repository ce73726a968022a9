"""The console's webhooks (api/ops/webhooks.py, ``storyjobs webhooks``): the
endpoints with their health, their recent deliveries, and retrying a dead
delivery. One method per query of sql/console.sql, its name the query's."""

from __future__ import annotations

import uuid

from shared.console_rows import WebhookDeliveryRow, WebhookEndpointAdminRow
from shared.store import Conn, fetch_all, fetch_scalars


class ConsoleWebhooks:
    """The webhooks' queries, on the console's connection
    (ConsoleStore.webhooks). Every method may raise any of
    ``shared.db.DB_ERRORS``."""

    __slots__ = ("conn",)

    def __init__(self, conn: Conn) -> None:
        self.conn = conn

    async def webhook_endpoint_list(self, *, client_id: int | None = None) -> list[WebhookEndpointAdminRow]:
        return await fetch_all(self.conn, WebhookEndpointAdminRow, "webhook_endpoint_list", {"client_id": client_id})

    async def webhook_delivery_list(
        self, *, endpoint_id: uuid.UUID | None = None, state: str | None = None, limit: int = 50
    ) -> list[WebhookDeliveryRow]:
        return await fetch_all(self.conn, WebhookDeliveryRow, "webhook_delivery_list",
                               {"endpoint_id": endpoint_id, "state": state, "limit": limit})

    async def webhook_delivery_retry(self, *, delivery_id: int) -> uuid.UUID | None:
        """dead -> pending, due now; the delivery's job (its public id), or
        None: no dead delivery of that id. Record the operator's action in
        the same transaction."""
        found = await fetch_scalars(self.conn, "webhook_delivery_retry", {"delivery_id": delivery_id})
        return uuid.UUID(str(found[0])) if found else None
