"""Connections and pools. Every connection is autocommit: a statement is its
own transaction unless a query function opens one on purpose."""

from __future__ import annotations

from typing import Any

import msgspec
import psycopg
from psycopg import AsyncConnection
from psycopg.types.json import set_json_loads
from psycopg_pool import AsyncConnectionPool

from shared import migrate, store
from shared.config import BaseSettings

# msgspec decodes jsonb several times faster than the json module
set_json_loads(msgspec.json.decode)


class SchemaBehind(RuntimeError):
    """The database has not been migrated to what this code needs."""


def database_url(settings: BaseSettings) -> str:
    """DATABASE_URL, or the embedded Postgres's when it is unset."""
    if settings.database_url:
        return settings.database_url
    from shared import embedded

    return embedded.url()


def connect_kwargs(
    *,
    application_name: str,
    connect_timeout_s: float,
    statement_timeout_s: float | None = None,
    generic_plans: bool = False,
) -> dict[str, Any]:
    options = []
    if statement_timeout_s:
        options.append(f"-c statement_timeout={int(statement_timeout_s * 1000)}")
    if generic_plans:
        # The worker's statements run thousands of times a second, so they are
        # planned once (a custom plan per execution costs as much as running
        # it). Every one of them finds its rows through an index, by id or on
        # the live-jobs index; with sequential scans off, a plan made while a
        # table was nearly empty (a fresh database, a new connection at the
        # start of a burst) still uses the index when the table has grown.
        options.append("-c plan_cache_mode=force_generic_plan -c enable_seqscan=off")
    return {
        "autocommit": True,
        "application_name": application_name,
        "connect_timeout": max(1, round(connect_timeout_s)),
        "options": " ".join(options),
        # notice a dead server or a cut network in seconds, not hours
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
    }


async def connect(url: str, **kwargs: Any) -> AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(url, **connect_kwargs(**kwargs))


def make_pool(
    url: str,
    *,
    application_name: str,
    connect_timeout_s: float,
    statement_timeout_s: float | None,
    min_size: int,
    max_size: int,
    wait_timeout_s: float,
    generic_plans: bool = False,
) -> AsyncConnectionPool:
    """A pool that is not yet open: ``await pool.open()`` (or ``async with``)."""
    return AsyncConnectionPool(
        url,
        kwargs=connect_kwargs(
            application_name=application_name,
            connect_timeout_s=connect_timeout_s,
            statement_timeout_s=statement_timeout_s,
            generic_plans=generic_plans,
        ),
        min_size=min_size,
        max_size=max_size,
        timeout=wait_timeout_s,
        open=False,
        # A failed connection attempt is not retried in the background with a
        # growing backoff: the next caller that needs a connection tries
        # again, so service resumes as soon as the database is back.
        reconnect_timeout=0,
        name=application_name,
    )


async def require_schema(conn: AsyncConnection[Any]) -> int:
    """Raises SchemaBehind unless the database is migrated to at least this
    code's latest migration; returns the database's version."""
    version = await store.schema_version_get(conn)
    needed = migrate.latest_version()
    if version is None or version < needed:
        raise SchemaBehind(
            f"the database schema is at version {version or 0} but this storyjobs needs "
            f"version {needed}: run `storyjobs migrate` first"
        )
    return version
