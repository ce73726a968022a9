"""Schema migrations: the numbered files in sql/ (``NNN_name.sql``), applied
in order, each in its own transaction, recorded in schema_migrations.

A session advisory lock is held for the whole run, so replicas that start at
once migrate one after the other; the second finds nothing left to do. The
connection must keep its session: never one through a transaction pooler
(``storyjobs migrate`` uses ``db.session_url``).
"""

from __future__ import annotations

import re
from functools import cache
from importlib.resources import files
from typing import Any

import msgspec
import structlog
from psycopg import AsyncConnection
from psycopg.errors import Diagnostic

from shared import store

_log = structlog.get_logger()

_FILE = re.compile(r"^(\d{3})_(\w+)\.sql$")


class Migration(msgspec.Struct, frozen=True):
    version: int
    name: str
    ddl: str


@cache
def migrations() -> tuple[Migration, ...]:
    found = []
    for entry in files("sql").iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"sql/ migrations must be numbered 001, 002, ... without gaps: {versions}")
    return tuple(found)


def latest_version() -> int:
    return migrations()[-1].version


class Applied(msgspec.Struct, frozen=True):
    """A migration applied now, with what it reported (its NOTICEs: a
    migration that rewrites data says what it changed)."""

    version: int
    name: str
    notices: tuple[str, ...] = ()


async def migrate(conn: AsyncConnection[Any]) -> list[Applied]:
    """Applies the migrations the database lacks; returns them. Then keeps
    the database's own settings (jit off), which a restored or copied
    database lacks however far it is migrated."""
    applied: list[Applied] = []
    heard: list[str] = []

    def hear(notice: Diagnostic) -> None:
        if notice.severity_nonlocalized == "NOTICE" and notice.message_primary:
            heard.append(notice.message_primary)

    await store.schema_migrations_lock(conn)
    conn.add_notice_handler(hear)
    try:
        await store.schema_migrations_create(conn)
        done = set(await store.schema_migrations_applied(conn))
        for migration in migrations():
            if migration.version not in done:
                heard.clear()
                await store.schema_migration_apply(
                    conn, version=migration.version, name=migration.name, ddl=migration.ddl
                )
                applied.append(Applied(migration.version, migration.name, tuple(heard)))
        heard.clear()
        await store.database_settings_keep(conn)
        for notice in heard:
            _log.warning("migrate.database_settings_partial", notice=notice)
    finally:
        conn.remove_notice_handler(hear)
        await store.schema_migrations_unlock(conn)
    return applied
