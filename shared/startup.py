"""What every process does before serving: reach the database (waiting out
an outage) and refuse to run against a schema that is behind."""

from __future__ import annotations

import sys

import psycopg
import stamina
import structlog

from shared import db
from shared.config import BaseSettings

log = structlog.get_logger()

# how long between two tries at most, however long the outage lasts
RETRY_WAIT_MAX_S = 10.0
# the schema check's own statement timeout
STARTUP_STATEMENT_TIMEOUT_S = 30.0


class PoolerRefused(Exception):
    """A transaction pooler refused the connection's startup options."""


async def wait_for_schema(url: str, settings: BaseSettings, *, process: str) -> int:
    """Returns the schema version once the database answers (retrying with
    stamina's jittered backoff, without end); exits with one line when the
    schema is behind this code."""
    try:
        async for attempt in stamina.retry_context(
            on=psycopg.OperationalError, attempts=None, timeout=None, wait_initial=0.5, wait_max=RETRY_WAIT_MAX_S,
        ):
            with attempt:
                try:
                    # with the startup options the pools send (a statement
                    # timeout), so that a pooler which refuses them says so now
                    conn = await db.connect(url, application_name=f"storyjobs-{process}",
                                            connect_timeout_s=settings.db_connect_timeout_s,
                                            statement_timeout_s=STARTUP_STATEMENT_TIMEOUT_S,
                                            pooler=settings.database_pooler)
                    async with conn:
                        return await db.require_schema(conn)
                except psycopg.OperationalError as exc:
                    if db.refused_by_pooler(exc):
                        raise PoolerRefused from None
                    log.warning("database.unavailable", attempt=attempt.num, error=db.describe(exc))
                    raise
    except db.SchemaBehind as exc:
        sys.stderr.write(f"storyjobs {process}: {exc}\n")
        raise SystemExit(1) from None
    except PoolerRefused:
        # not an outage: waiting would log the same refusal forever
        sys.stderr.write(f"storyjobs {process}: {db.POOLER_REFUSED_OPTIONS}\n")
        raise SystemExit(2) from None
    raise AssertionError("unreachable: stamina either returns or raises")
