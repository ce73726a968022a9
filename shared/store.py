"""The queries several callers share, and what every store is built on: the
connection type and where a store takes its connections, rows as msgspec
Structs, and one-line helpers that run a named query.

Each caller runs its own queries through its own store class, a method per
named query: ApiStore (api/store.py), PgWorkerStore (worker/pg_store.py),
PgSweeperStore (sweeper/store.py), PgDeliveryStore (worker/delivery/store.py),
BatchStore (worker/batch/store.py), and ConsoleStore (shared/console_store.py)
for the console and the ``storyjobs`` command. A store takes a pool, or one
open connection (autocommit, from shared.db): tests hold locks on a second
connection to force a race. This module's own functions are the queries more
than one caller runs: the migrations' ledger, the schema version, clients and
keys as shared/keys.py creates them, and the reads several callers make.
Handlers, loops and the CLI never hold SQL.

Every status change returns what it changed; an empty answer is a lost race,
which the caller logs and counts, never raises.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any, TypeVar

import msgspec
from psycopg import AsyncConnection, errors
from psycopg.rows import BaseRowFactory, scalar_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from shared.queries import QUERIES as Q
from shared.rows import (
    BudgetDay,
    CancelResult,
    JobIdBounds,
    KeyAuth,
    SnapshotAges,
)

Conn = AsyncConnection[Any]
# where a store takes its connections: a pool, or one connection (a test's,
# whose transactions and locks the store then shares)
Connections = AsyncConnectionPool | Conn
R = TypeVar("R")

MIGRATION_LOCK_KEY = 0x5354_4F52_594D_4947  # "STORYMIG"

_json_encoder = msgspec.json.Encoder(decimal_format="number")


@contextlib.asynccontextmanager
async def connection(source: Connections) -> AsyncIterator[Conn]:
    """A connection of the pool, or the one connection given."""
    if isinstance(source, AsyncConnectionPool):
        async with source.connection() as conn:
            yield conn
    else:
        yield source


def struct_row(row_type: type[R]) -> BaseRowFactory[R]:
    """Rows as msgspec Structs, converted by msgspec: a status arrives as a
    JobStatus, an error code as an ErrorCode, not as the text Postgres sent."""

    def factory(cursor: Any) -> Any:
        # the names straight from the result: cursor.description would build
        # a Column object per column, on every statement
        result = cursor.pgresult
        names = [(result.fname(i) or b"").decode() for i in range(result.nfields)] if result is not None else []

        def make_row(values: Sequence[Any]) -> R:
            return msgspec.convert(dict(zip(names, values, strict=True)), row_type)

        return make_row

    return factory


async def fetch_one(conn: Conn, row_type: type[R], query: str, params: dict[str, Any]) -> R | None:
    async with conn.cursor(row_factory=struct_row(row_type)) as cur:
        await cur.execute(Q[query], params)
        return await cur.fetchone()


async def fetch_all(conn: Conn, row_type: type[R], query: str, params: dict[str, Any]) -> list[R]:
    async with conn.cursor(row_factory=struct_row(row_type)) as cur:
        await cur.execute(Q[query], params)
        return await cur.fetchall()


async def fetch_scalars(conn: Conn, query: str, params: dict[str, Any] | None = None) -> list[Any]:
    async with conn.cursor(row_factory=scalar_row) as cur:
        await cur.execute(Q[query], params or {})
        return await cur.fetchall()


def jsonb(value: object) -> Jsonb:
    """A batch of records as one jsonb parameter (read with jsonb_to_recordset):
    one value to encode instead of an array per column."""
    return Jsonb(value, dumps=_json_encoder.encode)


# pg_advisory_xact_lock key for admissions (api/store.py), which a
# cancellation takes too: it gives a pending job's turn back to its client
ADMISSION_LOCK_KEY = 0x5354_4F52_594A_4F42  # "STORYJOB"


async def job_admission_lock(conn: Conn) -> None:
    """The admission lock, held until the transaction ends."""
    await conn.execute(Q["job_admission_lock"], {"lock_key": ADMISSION_LOCK_KEY})


async def job_cancel(conn: Conn, *, client_id: int | None, job_id: uuid.UUID) -> CancelResult | None:
    """A cancellation, a client's (its client_id) or an operator's (None,
    whoever's the job): pending or running -> failed (cancelled), a pending
    job's turn given back to its client under the admission lock, and the
    ledger row of a call the job left open closed, in one transaction sent as
    one round trip. None: no such job (for this client)."""
    async with conn.pipeline(), conn.transaction():
        await job_admission_lock(conn)
        cur = conn.cursor(row_factory=struct_row(CancelResult))
        await cur.execute(Q["job_cancel"], {"client_id": client_id, "job_id": job_id})
    return await cur.fetchone()


# -- schema --------------------------------------------------------------------------


async def schema_version_get(conn: Conn) -> int | None:
    (version,) = await fetch_scalars(conn, "schema_version_get")
    return None if version is None else int(version)


async def schema_migrations_create(conn: Conn) -> None:
    await conn.execute(Q["schema_migrations_create"])


async def schema_migrations_lock(conn: Conn) -> None:
    await conn.execute(Q["schema_migrations_lock"], {"lock_key": MIGRATION_LOCK_KEY})


async def schema_migrations_unlock(conn: Conn) -> None:
    await conn.execute(Q["schema_migrations_unlock"], {"lock_key": MIGRATION_LOCK_KEY})


async def database_settings_keep(conn: Conn) -> None:
    await conn.execute(Q["database_settings_keep"])


async def database_snapshot_ages(conn: Conn) -> SnapshotAges:
    row = await fetch_one(conn, SnapshotAges, "database_snapshot_ages", {})
    assert row is not None
    return row


async def schema_migrations_applied(conn: Conn) -> list[int]:
    return await fetch_scalars(conn, "schema_migrations_applied")


async def schema_migration_apply(conn: Conn, *, version: int, name: str, ddl: str) -> None:
    """Runs one migration file and records it, in one transaction."""
    async with conn.transaction():
        # A migration file is trusted DDL from sql/, never built from input.
        await conn.execute(ddl.encode())
        await conn.execute(Q["schema_migrations_record"], {"version": version, "name": name})


async def job_status_enum_values(conn: Conn) -> list[str]:
    return await fetch_scalars(conn, "job_status_enum_values")


# -- clients and keys ----------------------------------------------------------------


async def api_client_upsert(conn: Conn, *, name: str) -> int:
    (client_id,) = await fetch_scalars(conn, "api_client_upsert", {"name": name})
    return int(client_id)


async def api_client_budget_set(conn: Conn, *, client_id: int, budget_usd_per_day: Decimal) -> None:
    await conn.execute(Q["api_client_budget_set"], {"client_id": client_id, "budget_usd_per_day": budget_usd_per_day})


async def api_client_weight_set(conn: Conn, *, client_id: int, weight: int) -> bool:
    """False: no such client."""
    cur = await conn.execute(Q["api_client_weight_set"], {"client_id": client_id, "weight": weight})
    return await cur.fetchone() is not None


async def api_key_insert(conn: Conn, *, client_id: int, key_prefix: str, key_hash: bytes) -> None:
    await conn.execute(
        Q["api_key_insert"], {"client_id": client_id, "key_prefix": key_prefix, "key_hash": key_hash}
    )


async def api_key_get(conn: Conn, *, key_prefix: str) -> KeyAuth | None:
    return await fetch_one(conn, KeyAuth, "api_key_get", {"key_prefix": key_prefix})


async def operator_key_insert(conn: Conn, *, name: str, key_prefix: str, key_hash: bytes) -> None:
    await conn.execute(Q["operator_key_insert"], {"name": name, "key_prefix": key_prefix, "key_hash": key_hash})


# -- read by the console and the sweeper ---------------------------------------------


async def lock_timeout_set(conn: Conn, lock_timeout_s: float) -> None:
    """How long the statements of the current transaction may wait for a lock (at least 1 ms)."""
    await conn.execute(Q["transaction_lock_timeout_set"], {"lock_timeout_ms": max(1, round(lock_timeout_s * 1000))})


async def within_lock_timeout(conn: Conn, lock_timeout_s: float, work: Callable[[], Awaitable[R]]) -> R | None:
    """``work`` in a transaction whose statements wait at most ``lock_timeout_s`` for a lock: what it returns,
    or None, the transaction rolled back, when one of them did not get its lock in time (a sweeper's pass
    leaves that work to the next, rather than hold the statements queued behind its wait)."""
    try:
        async with conn.transaction():
            await lock_timeout_set(conn, lock_timeout_s)
            return await work()
    except errors.LockNotAvailable:
        return None


async def job_id_bounds(
    conn: Conn, *, created_after: datetime | None, created_before: datetime | None
) -> JobIdBounds:
    row = await fetch_one(conn, JobIdBounds, "job_id_bounds",
                     {"created_after": created_after, "created_before": created_before})
    assert row is not None
    return row


async def budget_days_today(conn: Conn, *, now: datetime | None = None) -> list[BudgetDay]:
    return await fetch_all(conn, BudgetDay, "budget_days_today", {"now": now})
