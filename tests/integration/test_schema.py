"""The schema, its migrations and the status enum."""

from __future__ import annotations

import asyncio
import re
from enum import StrEnum
from typing import Any

import psycopg
import pytest

from shared import db, migrate, store
from shared.status import ErrorCode, JobStatus, Lane, LlmOutcome
from tests.support.database import client_id_of, enqueue
from tests.support.postgres_server import with_dbname


async def test_status_enum_matches_sql(conn: psycopg.AsyncConnection[Any]) -> None:
    """The Python JobStatus and the SQL job_status enum have the same values, in order."""
    assert await store.job_status_enum_values(conn) == [s.value for s in JobStatus]


async def test_lane_enum_matches_sql(conn: psycopg.AsyncConnection[Any]) -> None:
    """The Python Lane and the SQL job_lane enum have the same values, in order."""
    cur = await conn.execute("SELECT unnest(enum_range(NULL::job_lane))::text")
    assert [row[0] for row in await cur.fetchall()] == [lane.value for lane in Lane]


@pytest.mark.parametrize(("constraint", "vocabulary"), [
    ("error_code_known", ErrorCode),
    ("llm_outcome_known", LlmOutcome),
])
async def test_error_codes_and_ledger_outcomes_match_sql(
    conn: psycopg.AsyncConnection[Any], constraint: str, vocabulary: type[StrEnum]
) -> None:
    """The domain constraint that lists a column's values and the Python enum have the same values."""
    cur = await conn.execute("SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = %s", (constraint,))
    row = await cur.fetchone()
    assert row is not None, f"no constraint {constraint}"
    assert sorted(re.findall(r"'(\w+)'::text", row[0])) == sorted(v.value for v in vocabulary)


async def test_unknown_error_codes_and_outcomes_are_refused(conn: psycopg.AsyncConnection[Any]) -> None:
    """A value outside the vocabulary cannot be stored, nor an open ledger row with an end."""
    from tests.support.database import client_id_of, enqueue

    client = await client_id_of(conn)
    await enqueue(conn, client, "a fox")
    with pytest.raises(psycopg.errors.CheckViolation):
        await conn.execute("UPDATE story_jobs SET status = 'failed', completed_at = now(), error_code = 'oops'")
    await conn.execute("INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model) VALUES (1, 1, 'w', 'p', 'm')")
    with pytest.raises(psycopg.errors.CheckViolation):
        await conn.execute("UPDATE llm_calls SET outcome = 'exploded', finished_at = now()")
    with pytest.raises(psycopg.errors.CheckViolation):
        await conn.execute("UPDATE llm_calls SET finished_at = now()")


@pytest.mark.parametrize("assignment", [
    "max_tokens = 0", "input_tokens_estimate = -1", "reserved_usd = -0.01", "charged_usd = -1",
])
async def test_token_counts_and_money_are_never_negative(conn: psycopg.AsyncConnection[Any], assignment: str) -> None:
    """The bounds the columns' domains carry hold on every update that sets them."""
    await enqueue(conn, await client_id_of(conn), "a fox")
    with pytest.raises(psycopg.errors.CheckViolation):
        await conn.execute(f"UPDATE story_jobs SET {assignment}")


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
    from tests.support.database import client_id_of, enqueue

    client = await client_id_of(conn)
    await enqueue(conn, client, "a fox")
    with pytest.raises(psycopg.errors.CheckViolation):
        await conn.execute("UPDATE story_jobs SET status = 'failed', completed_at = now()")
    with pytest.raises(psycopg.errors.CheckViolation):
        await conn.execute("UPDATE story_jobs SET status = 'completed', completed_at = now()")
