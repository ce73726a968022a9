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
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import Phase, settings
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool

from shared import db
from tests.support import postgres_server
from tests.support.database import create_key
from tests.support.outcome import failed_in_call
from tests.support.pgbouncer import PgBouncer, PgBouncerUnavailable

# fixtures every tier shares: a tracer provider of a test's own (span_exporter, tracer_provider);
# the fake provider's batch endpoints on a settable clock (clock, server, fake)
pytest_plugins = ["tests.support.tracing", "tests.support.batches"]

_counter = itertools.count()

# make mutants: a counterexample found is a mutant killed, so the search stops
# there. Shrinking it would take Hypothesis up to five minutes of fresh
# databases per example, which is what a mutant's time limit would meet.
settings.register_profile("mutants", phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile(os.environ.get("STORYJOBS_HYPOTHESIS_PROFILE", "default"))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keeps the call phase's report on the test item, so that fixtures can show
    what they saw (process logs) when the test failed."""
    report = yield
    if report.when == "call":
        # an attribute of our own on pytest's Item, which declares none: read by failed_in_call
        item.rep_call = report  # type: ignore[attr-defined]
    return report


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """A maintenance connection string to the test Postgres server."""
    with postgres_server.server_url() as url:
        yield url


@pytest.fixture(scope="session")
def template_db(server_url: str) -> Iterator[str]:
    """A database migrated to the latest schema, used as the template."""
    name = f"storyjobs_template_{os.getpid()}"
    postgres_server.create_migrated_database(server_url, name)
    yield name
    postgres_server.drop_database(server_url, name)


@pytest.fixture
def database_url(server_url: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for this test only."""
    name = f"storyjobs_test_{os.getpid()}_{next(_counter)}"
    url = postgres_server.create_database_from_template(server_url, name, template_db)
    yield url
    postgres_server.drop_database(server_url, name)


@pytest.fixture
def database_name(database_url: str) -> str:
    return str(conninfo_to_dict(database_url)["dbname"])


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


@pytest.fixture
def pgbouncer_factory(server_url: str, request: pytest.FixtureRequest) -> Iterator[Callable[..., PgBouncer]]:
    """Starts PgBouncers (transaction pooling) in front of the test server with the
    options a test chooses, e.g. ``pgbouncer_factory(default_pool_size=2)``; all
    stopped when the test ends, their logs shown if it failed. Skips the test
    where PgBouncer cannot run."""
    started: list[PgBouncer] = []

    def start(**options: Any) -> PgBouncer:
        try:
            bouncer = PgBouncer(server_url, **options)
        except PgBouncerUnavailable as exc:
            pytest.skip(str(exc))
        started.append(bouncer)
        return bouncer

    yield start
    for bouncer in started:
        if failed_in_call(request):
            # pytest shows a failed test's output: the pooler's log
            print(f"----- pgbouncer :{bouncer.port} -----\n{bouncer.log()[-4000:]}")  # noqa: T201
        bouncer.stop()


@pytest.fixture
def pgbouncer(pgbouncer_factory: Callable[..., PgBouncer]) -> PgBouncer:
    """A PgBouncer in transaction pooling with 4 server connections per database; ``pgbouncer.url(name)``
    reaches database ``name`` through it."""
    return pgbouncer_factory(default_pool_size=4)
