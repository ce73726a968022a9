"""The tables as tests write and read them directly: jobs enqueued as the api
stores them, keys, rows and counts, and a sampler on the maintenance
database. (The code under test never reads tables this way.)"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import uuid
from decimal import Decimal
from typing import Any, Self

import msgspec
import psycopg

from api.admission import admission
from api.store import ApiStore
from shared import keys, store
from shared.config import ApiSettings
from shared.console_rows import JobFilter
from shared.console_store import ConsoleStore
from shared.queries import QUERIES
from shared.story_request import StoryRequest
from tests.support import postgres_server
from worker.rows import Completion


def story_written(job_id: int) -> Completion:
    """A worker's written story for job_id, first attempt, as the round's settle takes it."""
    return Completion(job_id=job_id, client_id=1, attempt=1, title="T", body="B", model="m", prompt_version="v",
                      input_tokens=1, output_tokens=2, cost_usd=Decimal("0.01"), request_id=None)


async def client_id_of(conn: psycopg.AsyncConnection[Any], name: str = "tester") -> int:
    return await store.api_client_upsert(conn, name=name)


async def enqueue(
    conn: psycopg.AsyncConnection[Any], client_id: int, prompt: str, *, key: str | None = None,
    queue_max: int = 1_000_000,
) -> uuid.UUID:
    """Stores a pending job the way the api does; returns its job_id."""
    (result,) = await ApiStore(conn).job_insert_if_admitted(
        admissions=[admission(client_id, key or uuid.uuid4().hex, StoryRequest(prompt=prompt), ApiSettings())],
        queue_max=queue_max,
        client_queue_max=queue_max,
    )
    assert result.outcome == "inserted" and result.public_id is not None, result
    return result.public_id


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
    cur = await conn.execute(query, params)
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def pages_read(conn: psycopg.AsyncConnection[Any], query_name: str, params: dict[str, Any], *,
                     admission_lock: bool = False) -> int:
    """The pages one run of a named statement reads (EXPLAIN ANALYZE BUFFERS), rolled back; after the
    admission lock when the statement runs under it."""
    async with conn.transaction(force_rollback=True):
        if admission_lock:
            await store.job_admission_lock(conn)
        cur = await conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + QUERIES[query_name], params)
        row = await cur.fetchone()
    assert row is not None
    plan = row[0][0]["Plan"]
    return int(plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0))


async def claim_floor(conn: psycopg.AsyncConnection[Any]) -> float:
    """The claim's floor (migration 030): the turn the claim's walk starts at."""
    cur = await conn.execute("SELECT turn FROM job_claim_floor")
    row = await cur.fetchone()
    assert row is not None
    return float(row[0])


async def waiting_on_a_lock(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether some session of conn's database waits for a lock: how a test
    knows the statement it started now waits on the row it holds."""
    return await count(conn, "SELECT count(*) FROM pg_stat_activity "
                             "WHERE datname = current_database() AND wait_event_type = 'Lock'") > 0


def rows_sync(database_url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    """A query's rows on a connection of its own, for tests that drive
    processes rather than an event loop."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


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
            with postgres_server.admin(self._server_url) as conn:
                while not self._stop.is_set():
                    self.sample(conn)
                    self._stop.wait(self._interval_s)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread by __exit__
            self._error = exc


async def enqueue_batch(conn: psycopg.AsyncConnection[Any], client_id: int, prompt: str, *,
                        waited_s: float = 3600.0) -> uuid.UUID:
    """A job of the batch lane, admitted as the api admits it (its worst case
    reserved at the batch price against a day's budget of 1,000 USD), then
    waiting ``waited_s`` longer, so that a collection is due. (Its
    created_at, the day its reservation is held on, stays as admitted.)"""
    request = StoryRequest(prompt=prompt, lane="batch")
    (result,) = await ApiStore(conn).job_insert_if_admitted(
        admissions=[admission(client_id, uuid.uuid4().hex, request, ApiSettings())],
        queue_max=1_000_000, client_queue_max=1_000_000, budget_usd=Decimal(1000))
    assert result.outcome == "inserted" and result.public_id is not None, result
    await conn.execute(
        "UPDATE story_jobs SET batch_ready_at = batch_ready_at - make_interval(secs => %(waited_s)s) "
        "WHERE public_id = %(job_id)s",
        {"job_id": result.public_id, "waited_s": waited_s})
    return result.public_id


async def cancel_pending_in_bulk(conn: psycopg.AsyncConnection[Any], client_id: int) -> list[uuid.UUID]:
    """The console's bulk cancel of a client's pending jobs, as its handler
    runs it: counted, then cancelled up to the last one counted. Returns the
    jobs it cancelled (none when none was pending)."""
    filters = JobFilter(client_id=client_id)
    counted = await ConsoleStore(conn).jobs.ops_job_count_pending(filters=filters)
    if counted.through_id is None:
        return []
    return await ConsoleStore(conn).jobs.ops_job_cancel_pending(filters=filters, through_id=counted.through_id)
