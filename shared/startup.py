"""What every process does before serving: reach the database (waiting out
an outage) and refuse to run against a schema that is behind."""

from __future__ import annotations

import asyncio
import sys

import psycopg
import structlog

from shared import db
from shared.config import BaseSettings

log = structlog.get_logger()


async def wait_for_schema(url: str, settings: BaseSettings, *, process: str) -> int:
    """Returns the schema version once the database answers; exits with one
    line when the schema is behind this code."""
    delay = 0.5
    while True:
        try:
            conn = await db.connect(url, application_name=f"storyjobs-{process}",
                                    connect_timeout_s=settings.db_connect_timeout_s)
            async with conn:
                return await db.require_schema(conn)
        except db.SchemaBehind as exc:
            sys.stderr.write(f"storyjobs {process}: {exc}\n")
            raise SystemExit(1) from None
        except psycopg.OperationalError as exc:
            log.warning("database.unavailable", retry_in_s=delay, error=str(exc).strip().splitlines()[0])
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
