"""What the api asks of the database: ``ApiStore``, its queries on one
connection, each a method running one named query of sql/api.sql:
admission, a client's jobs and stories, cancellation, the pacing hint, a
client's webhook endpoints, and the readiness probe.

Handlers are given an ApiStore (api/deps.py), never a connection, and hold
no SQL; tests seed through the same methods (``ApiStore(conn)``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from decimal import Decimal

import msgspec
from psycopg.types.json import Jsonb

from api.rows import (
    Admission,
    DrainStats,
    EnqueueResult,
    IdempotentLookup,
    JobRead,
    JobView,
    StoryView,
)
from shared import store as shared_store
from shared.queries import QUERIES as Q
from shared.rows import CancelResult, KeyAuth, WebhookEndpointRow
from shared.store import Conn, fetch_all, fetch_one, fetch_scalars, jsonb, struct_row

_job_read = msgspec.json.Decoder(JobRead)


class ApiStore:
    """The api's queries on one connection: the request's (given by
    api/deps.py under the request's deadline), or one the admission batch or
    the drain statistics take from the pool. Every method may raise any of
    ``shared.db.DB_ERRORS``."""

    __slots__ = ("conn",)

    def __init__(self, conn: Conn) -> None:
        self.conn = conn

    async def ping(self) -> None:
        """Raises unless the database answers a statement (readiness)."""
        await self.conn.execute(Q["server_ping"])

    async def api_key_get(self, *, key_prefix: str) -> KeyAuth | None:
        """A client's key (api/auth.py): the query the console's operator
        check shares (shared/store.py)."""
        return await shared_store.api_key_get(self.conn, key_prefix=key_prefix)

    # -- jobs and stories ------------------------------------------------------------

    async def job_get_by_idempotency_key_for_key(
        self, *, key_prefix: str, idempotency_key: str
    ) -> IdempotentLookup | None:
        return await fetch_one(self.conn, IdempotentLookup, "job_get_by_idempotency_key_for_key",
                               {"key_prefix": key_prefix, "idempotency_key": idempotency_key})

    async def job_insert_if_admitted(
        self, *, admissions: Sequence[Admission], queue_max: int, client_queue_max: int,
        budget_usd: Decimal | None = None, client_budget_usd: Decimal | None = None,
        batch_queue_max: int = 10_000, client_batch_queue_max: int = 5_000,
    ) -> list[EnqueueResult]:
        """Takes the admission lock, then admits the batch, both lanes, in
        order while their queues and the spend budgets have room: one
        statement (sql/api.sql) in one transaction, sent as a single
        pipelined round trip. One result per admission, in the same order.
        The batch must not hold one (client, key) twice."""
        params = {"requests": _requests(admissions), "queue_max": queue_max, "client_queue_max": client_queue_max,
                  "batch_queue_max": batch_queue_max, "client_batch_queue_max": client_batch_queue_max,
                  "budget_usd": budget_usd, "client_budget_usd": client_budget_usd}
        async with self.conn.pipeline(), self.conn.transaction():
            await shared_store.job_admission_lock(self.conn)
            cur = self.conn.cursor(row_factory=struct_row(EnqueueResult))
            await cur.execute(Q["job_insert_if_admitted"], params)
        return await cur.fetchall()

    async def job_get_for_key(self, *, key_prefix: str, job_id: uuid.UUID, since: int = 0) -> JobView | None:
        """The key's client and, if it is theirs, the job (a running job's
        draft from character ``since``); None: no such key. Read as a tuple,
        the job decoded from the JSON the statement sends."""
        async with self.conn.cursor() as cur:
            await cur.execute(Q["job_get_for_key"], {"key_prefix": key_prefix, "job_id": job_id, "since": since})
            row = await cur.fetchone()
        if row is None:
            return None
        client_id, key_hash, revoked, job = row
        return JobView(client_id=client_id, key_hash=key_hash, revoked=revoked,
                       job=None if job is None else _job_read.decode(job))

    async def story_get_for_key(self, *, key_prefix: str, story_id: uuid.UUID) -> StoryView | None:
        return await fetch_one(self.conn, StoryView, "story_get_for_key",
                               {"key_prefix": key_prefix, "story_id": story_id})

    async def job_cancel(self, *, client_id: int, job_id: uuid.UUID) -> CancelResult | None:
        """The cancellation the console's shares (shared/store.py)."""
        return await shared_store.job_cancel(self.conn, client_id=client_id, job_id=job_id)

    async def job_drain_stats(self, *, model: str = "") -> DrainStats:
        row = await fetch_one(self.conn, DrainStats, "job_drain_stats", {"model": model})
        assert row is not None
        return row

    # -- webhook endpoints -----------------------------------------------------------

    async def webhook_endpoint_insert(
        self, *, client_id: int, url: str, events: Sequence[str], secret: str, max_per_client: int
    ) -> WebhookEndpointRow | None:
        """None: the client has max_per_client endpoints already. Takes the
        client's registration lock, then counts and inserts, in one
        transaction sent as a single pipelined round trip, so concurrent
        registrations of one client never make more than max_per_client."""
        params = {"client_id": client_id, "url": url, "events": list(events), "secret": secret,
                  "max_per_client": max_per_client}
        async with self.conn.pipeline(), self.conn.transaction():
            await self.conn.execute(Q["webhook_endpoint_insert_lock"], {"client_id": client_id})
            cur = self.conn.cursor(row_factory=struct_row(WebhookEndpointRow))
            await cur.execute(Q["webhook_endpoint_insert"], params)
        return await cur.fetchone()

    async def webhook_endpoint_list_for_client(self, *, client_id: int) -> list[WebhookEndpointRow]:
        return await fetch_all(self.conn, WebhookEndpointRow, "webhook_endpoint_list_for_client",
                               {"client_id": client_id})

    async def webhook_endpoint_delete(self, *, client_id: int, endpoint_id: uuid.UUID) -> bool:
        return bool(await fetch_scalars(self.conn, "webhook_endpoint_delete",
                                        {"client_id": client_id, "endpoint_id": endpoint_id}))

    async def webhook_endpoint_rotate_secret(
        self, *, client_id: int, endpoint_id: uuid.UUID, secret: str, overlap_s: float
    ) -> WebhookEndpointRow | None:
        return await fetch_one(self.conn, WebhookEndpointRow, "webhook_endpoint_rotate_secret",
                               {"client_id": client_id, "endpoint_id": endpoint_id, "secret": secret,
                                "overlap_s": overlap_s})


def _requests(admissions: Sequence[Admission]) -> Jsonb:
    return jsonb([
        {
            "ord": ord_,
            "lane": a.lane.value,
            "client_id": a.client_id,
            "idempotency_key": a.idempotency_key,
            "request_fingerprint": a.request_fingerprint.hex(),
            "request": msgspec.Raw(a.request_json.encode()),
            "max_tokens": a.max_tokens,
            "input_tokens_estimate": a.input_tokens_estimate,
            "worst_case_usd": a.worst_case_usd,
            "model": a.model,
            "input_usd_per_mtok": a.input_usd_per_mtok,
            "output_usd_per_mtok": a.output_usd_per_mtok,
            "trace_context": a.trace_context or None,
        }
        for ord_, a in enumerate(admissions)
    ])
