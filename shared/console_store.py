"""What operators read and do, from the console (api/ops/) and from the
``storyjobs`` command (tools/cli.py), so that the two answer each question
with one query and one row type (shared/console_rows.py): ``ConsoleStore``,
one connection, and its queries by concern, each a method named as its
query in sql/console.sql:

- ``jobs``: the jobs list, a job, its calls, cancelling by filter, the
  batches (shared/console_jobs.py);
- ``clients``: clients and their keys, operators' keys
  (shared/console_clients.py);
- ``webhooks``: endpoints, deliveries, a retry (shared/console_webhooks.py);
- ``stats``: the overview, history, workers (shared/console_stats.py);
- and here the operators' actions, recorded in the transaction of what they
  did.

The common reads and changes the console makes too (job_id_bounds,
job_cancel, api_client_weight_set, budget_days_today,
database_snapshot_ages) are shared/store.py's functions, called on
``conn``."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

from shared.console_clients import ConsoleClients
from shared.console_jobs import ConsoleJobs
from shared.console_rows import OperatorAction, OperatorActionRow
from shared.console_stats import ConsoleStats
from shared.console_webhooks import ConsoleWebhooks
from shared.queries import QUERIES as Q
from shared.store import Conn, fetch_all, jsonb


class ConsoleStore:
    """What operators read and do, on one connection: the request's under the
    console (api/ops/guard.py gives it, the operator's key checked on it), or
    the ``storyjobs`` command's. Every method may raise any of
    ``shared.db.DB_ERRORS``."""

    __slots__ = ("clients", "conn", "jobs", "stats", "webhooks")

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.jobs = ConsoleJobs(conn)
        self.clients = ConsoleClients(conn)
        self.webhooks = ConsoleWebhooks(conn)
        self.stats = ConsoleStats(conn)

    def transaction(self) -> AbstractAsyncContextManager[Any]:
        """One transaction around the calls made inside it: an action and its
        record in operator_actions commit together or not at all."""
        return self.conn.transaction()

    async def operator_action_insert(
        self, *, operator_key_id: int, action: OperatorAction, touched: int, job_id: uuid.UUID | None = None,
        filter: Mapping[str, Any] | None = None,
    ) -> None:
        """Records an operator's action; run it in the action's transaction."""
        await self.conn.execute(Q["operator_action_insert"], {
            "operator_key_id": operator_key_id, "action": action, "job_id": job_id,
            "filter": None if filter is None else jsonb(filter), "touched": touched})

    async def operator_action_list(self, *, limit: int, before_id: int | None = None) -> list[OperatorActionRow]:
        return await fetch_all(self.conn, OperatorActionRow, "operator_action_list",
                               {"limit": limit, "before_id": before_id})
