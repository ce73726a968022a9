"""Connections and pools. Every connection is autocommit: a statement is its
own transaction unless a query function opens one on purpose.

Behind a pooler in transaction mode (DATABASE_POOLER=transaction), two
consecutive transactions of one pooled connection may run on two different
server connections, so a pooled connection relies on no session state: it
sends no startup ``options``, prepares no statements, and its statement
timeout is kept by the client (``DeadlineConnection``). What needs a session
(LISTEN, a session advisory lock) connects to ``session_url`` instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
import psycopg
import structlog
from psycopg import AsyncConnection
from psycopg.types.json import set_json_loads
from psycopg_pool import AsyncConnectionPool

from shared import migrate, store
from shared.config import BaseSettings, ConfigError, Pooler

# msgspec decodes jsonb several times faster than the json module
set_json_loads(msgspec.json.decode)


# Every error a database call can raise: a lost connection, a pool that
# cannot hand one out (PoolTimeout is an OperationalError), and every error
# the server answers with (a read-only database during a failover, a
# serialization failure, a lock timeout, data it cannot store). A loop that
# talks to the database survives all of them.
DB_ERRORS: tuple[type[Exception], ...] = (psycopg.Error,)

# SQLSTATE classes of errors that go away by themselves: the same statement
# succeeds once the connection, the server's role or the lock is back.
_TRANSIENT_CLASSES = ("08", "25", "40", "53", "55", "57", "58")


def describe(exc: BaseException) -> str:
    """One short line for a log field: the error's first line, its SQLSTATE
    first when the server sent one."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    sqlstate = getattr(exc, "sqlstate", None)
    return (f"{sqlstate}: {text}" if sqlstate else text)[:200]


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same statement later can succeed: connection and
    pool errors, and server errors of the classes above. A data error or a
    constraint violation fails again with the same input."""
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate is None:
        return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))
    return sqlstate[:2] in _TRANSIENT_CLASSES


class ErrorEpisode:
    """Logs a run of database errors once, when it starts, and once more when
    it ends: a loop that retries every second during an outage writes two
    lines, not one per attempt."""

    def __init__(self, event: str, *, clock: Callable[[], float], **fields: Any) -> None:
        self._event = event
        self._clock = clock
        self._fields = fields
        self.since: float | None = None

    @property
    def ongoing(self) -> bool:
        return self.since is not None

    def failed(self, exc: BaseException, **fields: Any) -> None:
        if self.since is None:
            self.since = self._clock()
            _log.warning(f"{self._event}.database_error", sqlstate=getattr(exc, "sqlstate", None),
                         error=describe(exc), **self._fields, **fields)

    def succeeded(self) -> None:
        if self.since is not None:
            _log.info(f"{self._event}.database_recovered", down_s=round(self._clock() - self.since, 1),
                      **self._fields)
            self.since = None


_log = structlog.get_logger()


class SchemaBehind(RuntimeError):
    """The database has not been migrated to what this code needs."""


def database_url(settings: BaseSettings) -> str:
    """DATABASE_URL, or the embedded Postgres's when it is unset."""
    if settings.database_url:
        return settings.database_url
    from shared import embedded

    return embedded.url()


def session_url(settings: BaseSettings) -> str:
    """Where a connection that keeps its session goes (the worker's LISTEN,
    the migrations' advisory lock): DATABASE_LISTEN_URL, else DATABASE_URL.
    Behind a transaction pooler DATABASE_URL keeps no session, so then
    DATABASE_LISTEN_URL must be set (ConfigError)."""
    if settings.database_listen_url:
        return settings.database_listen_url
    if settings.database_pooler == "transaction":
        raise ConfigError(
            "DATABASE_LISTEN_URL is needed with DATABASE_POOLER=transaction: LISTEN and the migrations' "
            "advisory lock need a session, which a transaction pooler does not keep; set it to a direct "
            "connection to the database"
        )
    return database_url(settings)


class DeadlineConnection(AsyncConnection[Any]):
    """A pooled connection behind a transaction pooler, where a statement
    timeout cannot be a session setting: the client keeps it instead. Every
    wait for the server (a statement, a pipeline's results, a commit) ends
    after ``statement_timeout_s``: psycopg then sends the server a cancel
    request, which the pooler relays to the server connection running the
    statement, and the caller gets QueryCanceled, the error the server's own
    statement_timeout raises (a transient one, see ``is_transient``)."""

    statement_timeout_s: float | None = None

    async def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:
        if self.statement_timeout_s is None:
            return await super().wait(gen, *args, **kwargs)
        deadline = asyncio.timeout(self.statement_timeout_s)
        try:
            async with deadline:
                return await super().wait(gen, *args, **kwargs)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise psycopg.errors.QueryCanceled(
                f"canceling statement due to statement timeout ({self.statement_timeout_s:g} s, "
                "kept by the client)"
            ) from None


def _deadline_connection(statement_timeout_s: float | None) -> type[DeadlineConnection]:
    class Bounded(DeadlineConnection):
        pass

    Bounded.statement_timeout_s = statement_timeout_s
    return Bounded


def connect_kwargs(
    *,
    application_name: str,
    connect_timeout_s: float,
    statement_timeout_s: float | None = None,
    generic_plans: bool = False,
    pooler: Pooler = "none",
) -> dict[str, Any]:
    if pooler == "transaction":
        # A transaction pooler refuses startup options, and hands each
        # transaction whichever server connection is free: a statement
        # prepared on one would be missing (or a duplicate) on the next.
        # Every statement is then planned when it runs, with its parameters
        # (a custom plan), so the generic-plan settings below have no use.
        return {**_client_kwargs(application_name, connect_timeout_s), "prepare_threshold": None}
    # The database's own jit = off (`storyjobs migrate`) reaches connections
    # through a pooler too; a direct connection says it again, so that a
    # database restored without its settings still never compiles the
    # services' statements (see database_settings_keep in sql/common.sql).
    options = ["-c jit=off"]
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
    return {**_client_kwargs(application_name, connect_timeout_s), "options": " ".join(options)}


def _client_kwargs(application_name: str, connect_timeout_s: float) -> dict[str, Any]:
    """What every connection sends or sets, pooler or not. A pooler such as
    PgBouncer passes application_name on to the server connection a client
    is using, so pg_stat_activity names the process behind each one."""
    return {
        "autocommit": True,
        "application_name": application_name,
        "connect_timeout": max(1, round(connect_timeout_s)),
        # notice a dead server or a cut network in seconds, not hours
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
    }


# What a transaction pooler (PgBouncer) answers a connection that sends
# startup options, i.e. one made without DATABASE_POOLER=transaction.
POOLER_REFUSED_OPTIONS = (
    "DATABASE_URL leads to a transaction pooler, which refuses the startup options this process sends: "
    "set DATABASE_POOLER=transaction (and DATABASE_LISTEN_URL; see docs/pooler.md, \"Behind a pooler\")"
)


def refused_by_pooler(exc: BaseException) -> bool:
    """Whether a connection failed because a pooler refused its startup
    options (PgBouncer: ``unsupported startup parameter: options``)."""
    return isinstance(exc, psycopg.OperationalError) and "unsupported startup parameter: options" in str(exc)


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
    pooler: Pooler = "none",
) -> AsyncConnectionPool:
    """A pool that is not yet open: ``await pool.open()`` (or ``async with``).
    Behind a transaction pooler its connections keep the statement timeout
    on the client (DeadlineConnection) and prepare nothing."""
    connection_class = (
        _deadline_connection(statement_timeout_s) if pooler == "transaction" else psycopg.AsyncConnection
    )
    return AsyncConnectionPool(
        url,
        connection_class=connection_class,
        kwargs=connect_kwargs(
            application_name=application_name,
            connect_timeout_s=connect_timeout_s,
            statement_timeout_s=statement_timeout_s,
            generic_plans=generic_plans,
            pooler=pooler,
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
