"""``make run``'s keys: reused from one run to the next, never piling up."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import psycopg
import pytest

from shared import keys
from shared.console_store import ConsoleStore
from tools import devrun


async def _active_dev_keys(conn: psycopg.AsyncConnection[Any]) -> tuple[int, int]:
    clients = await (await conn.execute(
        "SELECT count(*) FROM api_keys k JOIN api_clients c ON c.id = k.client_id "
        "WHERE c.name = 'dev' AND k.revoked_at IS NULL")).fetchone()
    operators = await (await conn.execute(
        "SELECT count(*) FROM operator_keys WHERE name = 'dev' AND revoked_at IS NULL")).fetchone()
    assert clients is not None and operators is not None
    return int(clients[0]), int(operators[0])


async def test_make_run_reuses_its_development_keys_and_replaces_a_revoked_one(
    database_url: str, conn: psycopg.AsyncConnection[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second run gets the same client and operator keys, kept readable by the user alone; a kept key that was
    revoked is replaced, so exactly one active development key of each kind exists after every run."""
    monkeypatch.setenv("STORYJOBS_DATA_DIR", str(tmp_path))
    first = await devrun._prepare(database_url)
    second = await devrun._prepare(database_url)
    assert second == first
    assert await _active_dev_keys(conn) == (1, 1)
    assert stat.S_IMODE(devrun.dev_keys_path().stat().st_mode) == 0o600

    revoked_prefix = keys.prefix_of(first[0])
    assert revoked_prefix is not None and await ConsoleStore(conn).clients.api_key_revoke(key_prefix=revoked_prefix)
    third = await devrun._prepare(database_url)
    assert third[0] != first[0] and third[1] == first[1]
    assert await _active_dev_keys(conn) == (1, 1)
