"""The schema, its migrations and the status enum."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from shared import db, migrate, store
from shared.status import JobStatus
from tests.conftest import with_dbname


async def test_status_enum_matches_sql(conn: psycopg.AsyncConnection[Any]) -> None:
    """The Python JobStatus and the SQL job_status enum have the same values, in order."""
    assert await store.job_status_enum_values(conn) == [s.value for s in JobStatus]


async def test_migrate_is_idempotent(conn: psycopg.AsyncConnection[Any]) -> None:
    """Migrating an up-to-date database applies nothing and keeps the version."""
    assert await migrate.migrate(conn) == []
    assert await store.schema_version_get(conn) == migrate.latest_version()


async def test_concurrent_migrations_apply_each_file_once(server_url: str) -> None:
    """Replicas migrating an empty database at once apply every file exactly once."""
    name = "storyjobs_concurrent_migrate"
    async with await psycopg.AsyncConnection.connect(server_url, autocommit=True) as admin:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.execute(f"CREATE DATABASE {name}")
    try:
        async def one_replica() -> int:
            async with await psycopg.AsyncConnection.connect(with_dbname(server_url, name), autocommit=True) as c:
                return len(await migrate.migrate(c))

        applied = await asyncio.gather(*(one_replica() for _ in range(4)))
        assert sorted(applied) == [0, 0, 0, len(migrate.migrations())]
        async with await psycopg.AsyncConnection.connect(with_dbname(server_url, name), autocommit=True) as c:
            assert await store.schema_version_get(c) == migrate.latest_version()
    finally:
        async with await psycopg.AsyncConnection.connect(server_url, autocommit=True) as admin:
            await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


async def test_processes_refuse_a_schema_that_is_behind(conn: psycopg.AsyncConnection[Any]) -> None:
    """require_schema names the versions and the command to run when the database is behind."""
    await conn.execute("DELETE FROM schema_migrations")
    with pytest.raises(db.SchemaBehind, match=r"version 0 .* needs version \d+: run `storyjobs migrate`"):
        await db.require_schema(conn)


async def test_terminal_states_need_their_columns(conn: psycopg.AsyncConnection[Any]) -> None:
    """CHECK constraints refuse a failed job without an error code or a completed one without a story."""
    from tests.helpers import client_id_of, enqueue

    client = await client_id_of(conn)
    await enqueue(conn, client, "a fox")
    with pytest.raises(psycopg.errors.CheckViolation):
        await conn.execute("UPDATE story_jobs SET status = 'failed', completed_at = now()")
    with pytest.raises(psycopg.errors.CheckViolation):
        await conn.execute("UPDATE story_jobs SET status = 'completed', completed_at = now()")
