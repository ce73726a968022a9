"""API keys: hashed at rest, listed by prefix, revoked from the next request
on, and never written to a log line, like the prompts they send."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from shared import keys
from shared.console_store import ConsoleStore
from tests.support.api_client import api_client, assert_problem, new_key, stored_jobs
from tests.support.database import count
from tools import cli


async def _storyjobs(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Runs the ``storyjobs`` command (in a thread: it runs its own event loop); returns its exit code and
    standard output."""
    with pytest.raises(SystemExit) as exited:
        await asyncio.to_thread(cli.main, list(argv))
    return int(exited.value.code or 0), capsys.readouterr().out


async def test_keys_are_stored_as_hashes_and_listed_by_prefix(
    conn: psycopg.AsyncConnection[Any], api_key: str, database_url: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The table holds the key's SHA-256 and prefix, never the key; `storyjobs keys list` shows the prefix only."""
    prefix = keys.prefix_of(api_key)
    assert prefix is not None
    cur = await conn.execute("SELECT key_prefix, key_hash FROM api_keys")
    assert await cur.fetchall() == [(prefix, keys.hash_key(api_key))]
    monkeypatch.setenv("DATABASE_URL", database_url)
    code, listing = await _storyjobs(capsys, "keys", "list")
    assert code == 0 and prefix in listing and api_key not in listing
    secret = api_key.split("_", 2)[2]  # the secret itself may hold "_"
    assert len(secret) == 43 and secret not in listing


async def test_a_revoked_key_is_refused_from_the_next_request(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], api_key: str, database_url: str,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """`storyjobs keys revoke PREFIX` takes effect at once: the key's next GET and POST are 401 and store nothing."""
    async with api_client(pool, api_key) as client:
        accepted = await client.post("/stories/generate", json={"prompt": "a fox"}, headers=new_key())
        assert accepted.status_code == 202
        assert (await client.get(accepted.headers["location"])).status_code == 200
        monkeypatch.setenv("DATABASE_URL", database_url)
        code, _ = await _storyjobs(capsys, "keys", "revoke", str(keys.prefix_of(api_key)))
        assert code == 0
        refused = await client.get(accepted.headers["location"])
        posted = await client.post("/stories/generate", json={"prompt": "an owl"}, headers=new_key())
    assert_problem(refused, 401)
    assert refused.headers["www-authenticate"] == 'Bearer realm="storyjobs", error="invalid_token"'
    assert_problem(posted, 401)
    assert await stored_jobs(conn) == 1


async def test_a_second_key_of_a_client_survives_the_revocation_of_the_first(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], api_key: str
) -> None:
    """Rotation: with the old key revoked, the client's new key still reads the client's jobs."""
    from tests.support.database import create_key

    async with api_client(pool, api_key) as client:
        accepted = await client.post("/stories/generate", json={"prompt": "a fox"}, headers=new_key())
    rotated = await create_key(conn, "tester")
    assert await ConsoleStore(conn).clients.api_key_revoke(key_prefix=str(keys.prefix_of(api_key)))
    async with api_client(pool, rotated) as client:
        assert (await client.get(accepted.headers["location"])).status_code == 200


async def test_logs_carry_prefixes_lengths_and_ids_never_keys_or_prompts(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], api_key: str
) -> None:
    """Accepting, refusing and failing requests log the key's prefix, the prompt's length and the job id, but
    never the key, the prompt text, or a traceback that could hold either."""
    prompt = "a story for Amelia Hartwell, who is afraid of the dark"
    with capture_logs() as logs:
        async with api_client(pool, api_key) as client:
            accepted = await client.post("/stories/generate", json={"prompt": prompt}, headers=new_key())
            await client.post("/stories/generate", json={"prompt": prompt, "age": 40}, headers=new_key())
            await client.post("/stories/generate", json={"prompt": prompt},
                              headers={"Authorization": f"Bearer {api_key[:-1]}x", **new_key()})
            await client.delete(accepted.headers["location"])
            await pool.close()  # the database is gone for this app: 503s, logged
            down = await client.post("/stories/generate", json={"prompt": prompt}, headers=new_key())
            assert down.status_code == 503
    (event,) = [e for e in logs if e["event"] == "job.accepted"]
    assert event["key_prefix"] == keys.prefix_of(api_key) and event["prompt_chars"] == len(prompt)
    assert event["job_id"] == accepted.json()["job_id"]
    assert any(e["event"] == "api.database_unavailable" for e in logs)
    text = repr(logs)
    secret = api_key.split("_", 2)[2]  # the secret itself may hold underscores
    assert api_key not in text and secret not in text
    assert "Amelia" not in text and "exc_info" not in text
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE status = 'failed'") == 1
