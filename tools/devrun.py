"""``make run``: the whole system on one machine, for trying it out.

Uses DATABASE_URL, or starts the embedded Postgres (data in .data/); migrates;
reuses its development API key and operator key for the console (kept in
.data/dev-keys.json, readable by the user alone), or creates them when they
are missing or no longer valid in this database; starts the
api, two workers and the sweeper as separate processes; prints the URLs and a
curl example; on Ctrl-C stops them all (SIGTERM, so workers finish what they
hold) and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from psycopg import AsyncConnection

from shared import db, keys, migrate, store
from shared.config import ApiSettings, ConfigError
from shared.config_load import load
from shared.console_store import ConsoleStore


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def dev_keys_path() -> Path:
    """Where make run keeps its keys, beside the embedded Postgres's data."""
    return Path(os.environ.get("STORYJOBS_DATA_DIR", ".data")).resolve() / "dev-keys.json"


def _kept() -> dict[str, str]:
    try:
        kept = json.loads(dev_keys_path().read_text())
    except (OSError, ValueError):
        return {}
    return {name: value for name, value in kept.items() if isinstance(value, str)} if isinstance(kept, dict) else {}


def _keep(client_key: str, operator_key: str) -> None:
    path = dev_keys_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    # written readable by the user alone, before the keys go in
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(json.dumps({"key": client_key, "operator_key": operator_key}) + "\n")


async def _valid(conn: AsyncConnection[Any], key: str | None, *, operator: bool) -> bool:
    prefix = keys.prefix_of(key or "")
    if key is None or prefix is None:
        return False
    found = await (ConsoleStore(conn).clients.operator_key_get(key_prefix=prefix) if operator
                   else store.api_key_get(conn, key_prefix=prefix))
    return found is not None and not found.revoked and keys.matches(key, found.key_hash)


async def _prepare(url: str) -> tuple[str, str]:
    """Migrates; returns the development client key and operator key: the
    ones kept from the last run when this database still knows them, else
    new ones (and the kept ones, if this database has them, are revoked)."""
    kept = _kept()
    async with await db.connect(url, application_name="storyjobs-run", connect_timeout_s=10) as conn:
        for migration in await migrate.migrate(conn):
            _say(f"   applied migration {migration.version:03d}_{migration.name}")
        key, operator_key = kept.get("key"), kept.get("operator_key")
        if not await _valid(conn, key, operator=False):
            if (old := keys.prefix_of(key or "")) is not None:
                await ConsoleStore(conn).clients.api_key_revoke(key_prefix=old)
            key = (await keys.create(conn, "dev")).key
        if not await _valid(conn, operator_key, operator=True):
            if (old := keys.prefix_of(operator_key or "")) is not None:
                await ConsoleStore(conn).clients.operator_key_revoke(key_prefix=old)
            operator_key = (await keys.create_operator(conn, "dev")).key
    assert key is not None and operator_key is not None
    with contextlib.suppress(OSError):
        _keep(key, operator_key)
    return key, operator_key


def main() -> None:
    try:
        settings = load(ApiSettings)
    except ConfigError as exc:
        sys.exit(f"storyjobs: configuration error: {exc}")
    if settings.database_url:
        url = settings.database_url
        _say("== using DATABASE_URL")
    else:
        _say("== starting the embedded Postgres (data in .data/postgres)")
        url = db.database_url(settings)
    try:
        # the migrations hold a session advisory lock: not through a transaction pooler
        session = db.session_url(settings) if settings.database_url else url
    except ConfigError as exc:
        sys.exit(f"storyjobs: configuration error: {exc}")
    key, operator_key = asyncio.run(_prepare(session))
    env = {**os.environ, "DATABASE_URL": url}
    offline = not env.get("ANTHROPIC_API_KEY")
    processes: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(name: str, module: str, **extra: str) -> None:
        processes.append((name, subprocess.Popen([sys.executable, "-m", module], env={**env, **extra})))

    # the API documentation pages, for trying the api out (off by default)
    start("api", "api", API_DOCS_PAGES=env.get("API_DOCS_PAGES", "true"))
    start("worker-1", "worker", METRICS_PORT=env.get("WORKER_1_METRICS_PORT", "9100"))
    start("worker-2", "worker", METRICS_PORT=env.get("WORKER_2_METRICS_PORT", "9102"))
    start("sweeper", "sweeper", METRICS_PORT=env.get("SWEEPER_METRICS_PORT", "9101"))

    base = f"http://{settings.api_host}:{settings.api_port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    _say("")
    _say(f"== storyjobs is running at {base}  (Ctrl-C stops everything)")
    if offline:
        _say("   ANTHROPIC_API_KEY is not set: the workers use the offline story writer, and the batch lane "
             "the offline batch writer")
    _say(f"   page:     {base}/  (API key below)")
    _say(f"   API key:  {key}")
    _say(f"   console:  {base}/ops/  (operator key: {operator_key})")
    _say("   try it:")
    _say(f"""
curl -s -X POST {base}/stories/generate \\
  -H 'Authorization: Bearer {key}' \\
  -H "Idempotency-Key: $(date +%s%N)" \\
  -H 'Content-Type: application/json' \\
  -d '{{"prompt": "a dragon who cannot sleep", "child_name": "Mia", "age": 5}}'

curl -s {base}/stories/jobs/JOB_ID -H 'Authorization: Bearer {key}'

STORYJOBS_URL={base} STORYJOBS_API_KEY={key} .venv/bin/storyjobs generate "a dragon who cannot sleep" --wait

# the batch lane: within the day, half the price; usually within the hour (a batch every BATCH_COLLECT_S)
STORYJOBS_URL={base} STORYJOBS_API_KEY={key} .venv/bin/storyjobs generate "a whale who hums" --lane batch --wait
""")

    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        while not stopping:
            for name, proc in processes:
                if proc.poll() is not None:
                    _say(f"== {name} exited with {proc.returncode}; stopping the rest")
                    stopping = True
            time.sleep(0.3)
    finally:
        _say("== stopping")
        for _, proc in processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in processes:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _say(f"   {name} did not stop in time: killed")
                proc.kill()
        _say("== stopped")


if __name__ == "__main__":
    main()
