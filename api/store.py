"""What the api asks of the database: ``ApiStore``, its queries on one
connection, each run by one small typed function below (sql/api.sql):
admission, a client's jobs and stories, cancellation, the pacing hint, a
client's webhook endpoints, and the readiness probe.

Handlers are given an ApiStore (api/deps.py), never a connection, and hold
no SQL; the functions below stay for the tests that seed through them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from decimal import Decimal
from typing import Literal

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
from shared.queries import QUERIES as Q
from shared.rows import CancelResult, KeyAuth, WebhookEndpointRow
from shared.status import Lane

# the admission lock's key: a cancellation takes the lock too
from shared.store import ADMISSION_LOCK_KEY as ADMISSION_LOCK_KEY
from shared.store import (
    Conn,
    api_key_get,
    fetch_all,
    fetch_one,
    fetch_scalars,
    jsonb,
    struct_row,
)

# the cancellation is one statement for the client's DELETE and the console's
from shared.store import job_cancel as job_cancel


class ApiStore:
    """The api's queries on one connection: the request's (``store``, given by
    api/deps.py under the request's deadline), or one the admission batch or
    the drain statistics take from the pool. Every method may raise any of
    ``shared.db.DB_ERRORS``."""

    __slots__ = ("conn",)

    def __init__(self, conn: Conn) -> None:
        self.conn = conn

    async def ping(self) -> None:
        """Raises unless the database answers a statement (readiness)."""
        await server_ping(self.conn)

    async def api_key_get(self, *, key_prefix: str) -> KeyAuth | None:
        """A client's key, for a route that acts for the client (api/auth.py)."""
        return await api_key_get(self.conn, key_prefix=key_prefix)

    async def job_get_by_idempotency_key_for_key(
        self, *, key_prefix: str, idempotency_key: str
    ) -> IdempotentLookup | None:
        return await job_get_by_idempotency_key_for_key(self.conn, key_prefix=key_prefix,
                                                        idempotency_key=idempotency_key)

    async def job_insert_if_admitted(
        self, *, admissions: Sequence[Admission], queue_max: int, client_queue_max: int,
        budget_usd: Decimal | None = None, client_budget_usd: Decimal | None = None,
        batch_queue_max: int = 10_000, client_batch_queue_max: int = 5_000,
    ) -> list[EnqueueResult]:
        return await job_insert_if_admitted(self.conn, admissions=admissions, queue_max=queue_max,
                                            client_queue_max=client_queue_max, budget_usd=budget_usd,
                                            client_budget_usd=client_budget_usd, batch_queue_max=batch_queue_max,
                                            client_batch_queue_max=client_batch_queue_max)

    async def job_get_for_key(self, *, key_prefix: str, job_id: uuid.UUID, since: int = 0) -> JobView | None:
        return await job_get_for_key(self.conn, key_prefix=key_prefix, job_id=job_id, since=since)

    async def story_get_for_key(self, *, key_prefix: str, story_id: uuid.UUID) -> StoryView | None:
        return await story_get_for_key(self.conn, key_prefix=key_prefix, story_id=story_id)

    async def job_cancel(self, *, client_id: int, job_id: uuid.UUID) -> CancelResult | None:
        return await job_cancel(self.conn, client_id=client_id, job_id=job_id)

    async def job_drain_stats(self, *, model: str = "") -> DrainStats:
        return await job_drain_stats(self.conn, model=model)

    async def webhook_endpoint_insert(
        self, *, client_id: int, url: str, events: Sequence[str], secret: str, max_per_client: int
    ) -> WebhookEndpointRow | None:
        return await webhook_endpoint_insert(self.conn, client_id=client_id, url=url, events=events, secret=secret,
                                             max_per_client=max_per_client)

    async def webhook_endpoint_list_for_client(self, *, client_id: int) -> list[WebhookEndpointRow]:
        return await webhook_endpoint_list_for_client(self.conn, client_id=client_id)

    async def webhook_endpoint_delete(self, *, client_id: int, endpoint_id: uuid.UUID) -> bool:
        return await webhook_endpoint_delete(self.conn, client_id=client_id, endpoint_id=endpoint_id)

    async def webhook_endpoint_rotate_secret(
        self, *, client_id: int, endpoint_id: uuid.UUID, secret: str, overlap_s: float
    ) -> WebhookEndpointRow | None:
        return await webhook_endpoint_rotate_secret(self.conn, client_id=client_id, endpoint_id=endpoint_id,
                                                    secret=secret, overlap_s=overlap_s)


async def server_ping(conn: Conn) -> None:
    await conn.execute(Q["server_ping"])


# -- jobs and stories ----------------------------------------------------------------


async def job_get_by_idempotency_key_for_key(
    conn: Conn, *, key_prefix: str, idempotency_key: str
) -> IdempotentLookup | None:
    return await fetch_one(
        conn,
        IdempotentLookup,
        "job_get_by_idempotency_key_for_key",
        {"key_prefix": key_prefix, "idempotency_key": idempotency_key},
    )


async def job_insert_if_admitted(
    conn: Conn, *, admissions: Sequence[Admission], queue_max: int, client_queue_max: int,
    budget_usd: Decimal | None = None, client_budget_usd: Decimal | None = None,
    batch_queue_max: int = 10_000, client_batch_queue_max: int = 5_000,
) -> list[EnqueueResult]:
    """Takes the admission lock, then admits the batch in order while the
    queues and the spend budgets have room, in one transaction sent as a
    single pipelined round trip: the interactive lane's requests against
    QUEUE_MAX and their clients' turns, then the batch lane's against its
    own queue (sql/api.sql), both against the same budgets. One result per
    admission, in the same order. The batch must not hold one (client,
    key) twice."""
    interactive = [(n, a) for n, a in enumerate(admissions) if a.lane is Lane.INTERACTIVE]
    batch = [(n, a) for n, a in enumerate(admissions) if a.lane is Lane.BATCH]
    budgets = {"budget_usd": budget_usd, "client_budget_usd": client_budget_usd}
    cursors = []
    async with conn.pipeline(), conn.transaction():
        await conn.execute(Q["job_admission_lock"], {"lock_key": ADMISSION_LOCK_KEY})
        for query, asked, bounds in (
            ("job_insert_if_admitted", interactive, {"queue_max": queue_max, "client_queue_max": client_queue_max}),
            ("job_insert_batch_if_admitted", batch,
             {"queue_max": batch_queue_max, "client_queue_max": client_batch_queue_max}),
        ):
            if asked:
                cur = conn.cursor(row_factory=struct_row(EnqueueResult))
                await cur.execute(Q[query], {"requests": _requests(a for _, a in asked), **bounds, **budgets})
                cursors.append((asked, cur, query == "job_insert_batch_if_admitted"))
    answered: dict[int, EnqueueResult] = {}
    for asked, cur, batch_lane in cursors:
        for (n, _), result in zip(asked, await cur.fetchall(), strict=True):
            if batch_lane and result.outcome in ("queue_full", "client_queue_full"):
                result = msgspec.structs.replace(result, outcome=_BATCH_QUEUE_FULL[result.outcome])
            answered[n] = msgspec.structs.replace(result, ord=n)
    return [answered[n] for n in range(len(admissions))]


_BATCH_QUEUE_FULL: dict[str, Literal["batch_queue_full", "client_batch_queue_full"]] = {
    "queue_full": "batch_queue_full", "client_queue_full": "client_batch_queue_full"}


def _requests(admissions: Iterable[Admission]) -> Jsonb:
    return jsonb([
        {
            "ord": ord_,
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


_job_read = msgspec.json.Decoder(JobRead)


async def job_get_for_key(conn: Conn, *, key_prefix: str, job_id: uuid.UUID, since: int = 0) -> JobView | None:
    """The key's client and, if it is theirs, the job (a running job's draft
    from character ``since``); None: no such key. Read as a tuple, the job
    decoded from the JSON the statement sends."""
    async with conn.cursor() as cur:
        await cur.execute(Q["job_get_for_key"], {"key_prefix": key_prefix, "job_id": job_id, "since": since})
        row = await cur.fetchone()
    if row is None:
        return None
    client_id, key_hash, revoked, job = row
    return JobView(client_id=client_id, key_hash=key_hash, revoked=revoked,
                   job=None if job is None else _job_read.decode(job))


async def story_get_for_key(conn: Conn, *, key_prefix: str, story_id: uuid.UUID) -> StoryView | None:
    return await fetch_one(conn, StoryView, "story_get_for_key", {"key_prefix": key_prefix, "story_id": story_id})


async def job_drain_stats(conn: Conn, *, model: str = "") -> DrainStats:
    row = await fetch_one(conn, DrainStats, "job_drain_stats", {"model": model})
    assert row is not None
    return row


# -- webhook endpoints ---------------------------------------------------------------


async def webhook_endpoint_insert(
    conn: Conn, *, client_id: int, url: str, events: Sequence[str], secret: str, max_per_client: int
) -> WebhookEndpointRow | None:
    """None: the client has max_per_client endpoints already. Takes the
    client's registration lock, then counts and inserts, in one transaction
    sent as a single pipelined round trip, so concurrent registrations of one
    client never make more than max_per_client."""
    params = {"client_id": client_id, "url": url, "events": list(events), "secret": secret,
              "max_per_client": max_per_client}
    async with conn.pipeline(), conn.transaction():
        await conn.execute(Q["webhook_endpoint_insert_lock"], {"client_id": client_id})
        cur = conn.cursor(row_factory=struct_row(WebhookEndpointRow))
        await cur.execute(Q["webhook_endpoint_insert"], params)
    return await cur.fetchone()


async def webhook_endpoint_list_for_client(conn: Conn, *, client_id: int) -> list[WebhookEndpointRow]:
    return await fetch_all(conn, WebhookEndpointRow, "webhook_endpoint_list_for_client", {"client_id": client_id})


async def webhook_endpoint_delete(conn: Conn, *, client_id: int, endpoint_id: uuid.UUID) -> bool:
    return bool(await fetch_scalars(conn, "webhook_endpoint_delete",
                               {"client_id": client_id, "endpoint_id": endpoint_id}))


async def webhook_endpoint_rotate_secret(
    conn: Conn, *, client_id: int, endpoint_id: uuid.UUID, secret: str, overlap_s: float
) -> WebhookEndpointRow | None:
    return await fetch_one(conn, WebhookEndpointRow, "webhook_endpoint_rotate_secret",
                      {"client_id": client_id, "endpoint_id": endpoint_id, "secret": secret,
                       "overlap_s": overlap_s})
