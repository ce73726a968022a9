"""Small helpers shared by the integration and system tests."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, Self

import msgspec
import psycopg
from psycopg_pool import AsyncConnectionPool

from api import store as api_store
from api.admission import admission
from shared import keys, store
from shared.config import ApiSettings, SweeperSettings, WorkerSettings
from shared.ratelimit import RateLimits
from shared.rows import Completion
from shared.story_request import StoryRequest
from tests import dbserver
from worker.coordinator import Coordinator, new_worker_id
from worker.store import PgWorkerStore
from worker.writing import StoryWriter

# fast timings for tests; each test states the ones it depends on
FAST = {
    "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 1.0,
    "job_timeout_s": 30.0,
    "pending_timeout_s": 60.0,
}


# A sweeper pass (sweeper_store.job_fail_stale) as if run two hours from now: every
# running job's heartbeat and every job's age is then past these timeouts.
LATER = datetime.now(UTC) + timedelta(hours=2)
SWEEP = {"heartbeat_timeout_s": 60.0, "job_timeout_s": 480.0, "pending_timeout_s": 1800.0,
         "judge_running": True, "batch_size": 100, "lock_timeout_s": 5.0}


def story_written(job_id: int) -> Completion:
    """A worker's written story for job_id, first attempt, as the round statement takes it."""
    return Completion(job_id=job_id, client_id=1, attempt=1, title="T", body="B", model="m", prompt_version="v",
                      input_tokens=1, output_tokens=2, cost_usd=Decimal("0.01"), request_id=None)


def worker_settings(**overrides: Any) -> WorkerSettings:
    values: dict[str, Any] = {**FAST, "llm_timeout_s": 20.0, "llm_read_timeout_s": 5.0,
                              "worker_poll_interval_s": 0.5, "offline_delay_s": 0.0, "metrics_port": 0,
                              "worker_shutdown_grace_s": 5.0, **overrides}
    return WorkerSettings(**values)


def sweeper_settings(**overrides: Any) -> SweeperSettings:
    return SweeperSettings(**{**FAST, "sweeper_interval_s": 0.5, "metrics_port": 0, **overrides})


def api_settings(**overrides: Any) -> ApiSettings:
    return ApiSettings(**{"queue_max": 1000, **overrides})


async def client_id_of(conn: psycopg.AsyncConnection[Any], name: str = "tester") -> int:
    return await store.api_client_upsert(conn, name=name)


async def enqueue(
    conn: psycopg.AsyncConnection[Any], client_id: int, prompt: str, *, key: str | None = None,
    queue_max: int = 1_000_000,
) -> uuid.UUID:
    """Stores a pending job the way the api does; returns its job_id."""
    (result,) = await api_store.job_insert_if_admitted(
        conn,
        admissions=[admission(client_id, key or uuid.uuid4().hex, StoryRequest(prompt=prompt), ApiSettings())],
        queue_max=queue_max,
        client_queue_max=queue_max,
    )
    assert result.outcome == "inserted" and result.public_id is not None, result
    return result.public_id


REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def create_key(conn: psycopg.AsyncConnection[Any], client_name: str) -> str:
    """A new API key of client client_name."""
    return (await keys.create(conn, client_name)).key


def create_key_sync(database_url: str, client_name: str) -> str:
    """A new API key for client_name, from a test that is not async."""

    async def create() -> str:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            return await create_key(conn, client_name)

    # a thread of its own: the caller's thread may already run an event loop
    # (Playwright's sync API does)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, create()).result()


class JobRow(msgspec.Struct):
    id: int
    public_id: uuid.UUID
    status: str
    error_code: str | None
    worker_id: str | None
    story_id: uuid.UUID | None
    progress: int


async def job_rows(conn: psycopg.AsyncConnection[Any]) -> list[JobRow]:
    """Every job, for assertions (tests read tables directly; the code under
    test never does)."""
    cur = await conn.execute(
        "SELECT id, public_id, status::text, error_code, worker_id, story_id, progress FROM story_jobs ORDER BY id"
    )
    return [JobRow(*row) for row in await cur.fetchall()]


async def count(conn: psycopg.AsyncConnection[Any], query: str, *params: Any) -> int:
    cur = await conn.execute(query, params)  # type: ignore[arg-type]
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def waiting_on_a_lock(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether some session of conn's database waits for a lock: how a test
    knows the statement it started now waits on the row it holds."""
    return await count(conn, "SELECT count(*) FROM pg_stat_activity "
                             "WHERE datname = current_database() AND wait_event_type = 'Lock'") > 0


def _tries(timeout: float, what: str) -> Iterator[None]:
    """The one deadline of wait_until and wait_until_sync: a try each time
    round, then TimeoutError naming ``what`` once ``timeout`` seconds are past."""
    deadline = time.monotonic() + timeout
    while True:
        yield
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")


async def wait_until(
    check: Callable[[], bool | Awaitable[bool]], *, timeout: float = 10.0, what: str = "condition",
    interval: float = 0.02,
) -> None:
    """Returns once check() (a plain or an async function) is true; raises
    TimeoutError naming ``what`` after ``timeout`` seconds."""
    for _ in _tries(timeout, what):
        answer = check()
        if inspect.isawaitable(answer):
            answer = await answer
        if answer:
            return
        await asyncio.sleep(interval)


def rows_sync(database_url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    """A query's rows on a connection of its own, for tests that drive
    processes rather than an event loop."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()  # type: ignore[arg-type]


def wait_until_sync(
    check: Callable[[], bool], *, timeout: float = 10.0, what: str = "condition", interval: float = 0.02,
) -> None:
    """wait_until for code that is not async: fixtures and process helpers,
    which async tests call too (it blocks their loop while it waits)."""
    for _ in _tries(timeout, what):
        if check():
            return
        time.sleep(interval)


def worker_on(
    settings: WorkerSettings, pool: AsyncConnectionPool, writer: StoryWriter, *, listen_url: str | None,
    worker_id: str | None = None,
) -> Coordinator:
    """A worker coordinator on the test's pool, as python -m worker builds one."""
    store = PgWorkerStore(pool, worker_id=worker_id or new_worker_id(), provider=writer.provider,
                          model=writer.model, listen_url=listen_url, connect_timeout_s=5,
                          limits=RateLimits.from_settings(settings), default_max_tokens=settings.llm_max_tokens)
    return Coordinator(settings, store, writer, listen=listen_url is not None)


@contextlib.asynccontextmanager
async def running_worker(
    settings: WorkerSettings, pool: AsyncConnectionPool, writer: StoryWriter, *, listen_url: str | None,
) -> AsyncIterator[Coordinator]:
    """A worker coordinator running in this event loop; stopped (gracefully) on exit."""
    worker = worker_on(settings, pool, writer, listen_url=listen_url)
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        worker.stop()
        await asyncio.wait_for(task, timeout=30)


def failed_in_call(request: Any) -> bool:
    """Whether the test of a fixture's ``request`` failed (set by the hook in tests/conftest.py)."""
    report = getattr(request.node, "rep_call", None)
    return report is not None and bool(report.failed)


class AdminSampler:
    """Calls ``sample(conn)`` on a thread of its own every ``interval_s``,
    over a connection to the server's maintenance database (which a count of
    the tests' own connections does not see), from ``with`` until its end;
    an error on that thread is raised again when the block ends."""

    def __init__(self, server_url: str, interval_s: float) -> None:
        self._server_url = server_url
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self._error: BaseException | None = None

    def sample(self, conn: psycopg.Connection[Any]) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            with dbserver.admin(self._server_url) as conn:
                while not self._stop.is_set():
                    self.sample(conn)
                    self._stop.wait(self._interval_s)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread by __exit__
            self._error = exc
