"""What the deliverer asks of the database, as one typed interface.

``DeliveryStore`` is the claim of due deliveries and the record of one
attempt's end; ``PgDeliveryStore`` runs them with the named queries of
sql/worker.sql, one method per query, on the deliveries' own pool (or, for
a test, one connection). A recording fake of the same interface
(tests/fakes/recording_delivery_store.py) lets the loop's rules be tested
without a database. Every method may raise any of ``shared.db.DB_ERRORS``.
"""

from __future__ import annotations

from typing import Protocol

from shared import webhooks
from shared.store import Connections, connection, fetch_all, fetch_scalars
from worker.delivery.rows import DeliveryOutcome, WebhookDeliveryClaim


class DeliveryStore(Protocol):
    async def claim(self, limit: int, lease_s: float) -> list[WebhookDeliveryClaim]:
        """Up to ``limit`` due deliveries, each leased for ``lease_s`` under a
        new lease number, in the clients' turns."""
        ...

    async def finish(self, delivery_id: int, lease: int, outcome: DeliveryOutcome, *, retry_in_s: float = 0.0,
                     status_code: int | None = None, error: str | None = None) -> float | None:
        """Records how an attempt ended, under its lease; seconds from the
        event to now, or None: the attempt was no longer the delivery's."""
        ...


class PgDeliveryStore:
    """DeliveryStore on the deliveries' own connection pool, or on one
    connection (a test's, whose transactions it then shares)."""

    def __init__(self, connections: Connections) -> None:
        self._connections = connections

    async def claim(self, limit: int, lease_s: float) -> list[WebhookDeliveryClaim]:
        """Never an attempt past the schedule (webhooks.MAX_ATTEMPTS)."""
        async with connection(self._connections) as conn:
            return await fetch_all(conn, WebhookDeliveryClaim, "webhook_delivery_claim", {
                "limit": limit, "lease_s": lease_s, "max_attempts": webhooks.MAX_ATTEMPTS})

    async def finish(self, delivery_id: int, lease: int, outcome: DeliveryOutcome, *, retry_in_s: float = 0.0,
                     status_code: int | None = None, error: str | None = None) -> float | None:
        """None when the attempt was no longer the delivery's: its lease ran
        out and it was claimed again, an operator retried it, its end was
        already recorded, or its endpoint was deleted."""
        async with connection(self._connections) as conn:
            found = await fetch_scalars(conn, "webhook_delivery_finish", {
                "delivery_id": delivery_id, "lease": lease, "outcome": outcome, "retry_in_s": retry_in_s,
                "status_code": status_code, "error": error})
        return float(found[0]) if found else None
