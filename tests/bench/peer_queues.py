"""The systems of the peer comparison behind one interface: storyjobs, the
two Postgres queues it is compared with (pgqueuer and procrastinate), and
the bare claim-then-complete loop on storyjobs' own table, the floor.

Each one gets fresh databases copied from a template its own tooling
installed (storyjobs' migrations, ``pgqueuer install``, ``procrastinate
schema --apply``; the bare loop uses storyjobs' schema), is fed through its
own client (bulk, and one job at a time for pickup), runs real worker
processes (storyjobs' ``python -m worker``, procrastinate's own CLI, and
the runners in tests/bench/peer_apps/ for pgqueuer and the bare loop), and is timed by the
database's clock from the timestamps it keeps itself:

| system | picked at | finished at | enqueued at |
|---|---|---|---|
| storyjobs, bare | story_jobs.started_at | completed_at | created_at |
| pgqueuer | pgqueuer_log 'picked' | 'successful' | 'queued' |
| procrastinate | procrastinate_events 'started' | 'succeeded' | 'deferred' |

Every one of those is ``now()`` of the transaction that wrote it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import psycopg
from psycopg import sql

from tests.bench import drain, peer_apps
from tests.bench.harness import (
    BENCH_FINGERPRINT,
    BENCH_REQUEST_JSON,
    REPO,
    WORKER_LISTEN_APP,
    BenchContext,
    BenchDatabase,
    as_uri,
)
from tests.support.database import create_key_sync
from tests.system.procs import Proc, System

PGQUEUER_WORKER = "tests.bench.peer_apps.pgqueuer_app"
PROCRASTINATE_APP = "tests.bench.peer_apps.procrastinate_app.app"
BARE_WORKER = "tests.bench.peer_apps.bare_worker"

# storyjobs' api, for pickup: no admission bound in the way
API_ENV = {"QUEUE_MAX": 1_000_000, "CLIENT_QUEUE_MAX": 1_000_000}


@dataclass(frozen=True)
class DrainTiming:
    completed: int
    span_s: float


class Enqueuer:
    """Stores one job at a time the way the system's clients do; returns
    the key pickup_ms() finds it by."""

    async def __aenter__(self) -> Enqueuer:
        return self

    async def __aexit__(self, *_: object) -> None:
        return None

    async def enqueue(self) -> Any:
        raise NotImplementedError


class Queue:
    """One system under comparison."""

    name: str
    title: str
    # what one worker process runs, one job at a time and batched
    mode_one: str
    mode_batched: str
    # the application_name of the connections that show a worker is up, and
    # how many of them each worker opens by the time it waits for work
    ready_app: str
    ready_per_worker: int = 1

    def missing(self) -> str | None:
        """Why this system cannot run here (a package not installed), or None."""
        return None

    def prepare(self, ctx: BenchContext) -> None:
        """Builds the template its fresh databases are copied from."""

    def template(self) -> str | None:
        return None

    @contextlib.contextmanager
    def database(self, ctx: BenchContext, label: str) -> Iterator[BenchDatabase]:
        with ctx.database(f"{label}_{self.name}", template=self.template()) as bench_db:
            yield bench_db

    def enqueue_bulk(self, bench_db: BenchDatabase, count: int) -> None:
        raise NotImplementedError

    def start_workers(self, system: System, count: int, *, batched: bool, draining: bool) -> list[Proc]:
        raise NotImplementedError

    def unfinished(self, bench_db: BenchDatabase) -> int:
        raise NotImplementedError

    def drain_timing(self, bench_db: BenchDatabase) -> DrainTiming:
        raise NotImplementedError

    def enqueuer(self, system: System, bench_db: BenchDatabase) -> Enqueuer:
        raise NotImplementedError

    def pickup_ms(self, bench_db: BenchDatabase, keys: list[Any]) -> list[float]:
        raise NotImplementedError

    def ready_connections(self, bench_db: BenchDatabase) -> int:
        return bench_db.connections(self.ready_app)


def _vacuum_analyze(bench_db: BenchDatabase, *tables: str) -> None:
    """As autovacuum would have after a bulk insert, for every system alike."""
    with bench_db.connect() as conn:
        for table in tables:
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(table)))


def _module_missing(*modules: str) -> str | None:
    absent = [module for module in modules if importlib.util.find_spec(module) is None]
    if not absent:
        return None
    return (f"{', '.join(absent)} not installed: the peer comparison needs the bench extra "
            "(make bench installs it: pip install -e '.[test,bench]')")


def _run_tool(what: str, args: list[str], env: dict[str, str]) -> None:
    finished = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120, check=False)
    if finished.returncode != 0:
        raise RuntimeError(f"{what} failed ({finished.returncode}):\n{finished.stdout[-1500:]}"
                           f"{finished.stderr[-1500:]}")


def _tool_env(url: str, **extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"), "PYTHONPATH": str(REPO),
            "DATABASE_URL": url, **extra}


# -- storyjobs and the bare loop: the same table ---------------------------------------------

_STORY_JOBS_UNFINISHED = "SELECT count(*) FROM story_jobs WHERE status IN ('pending', 'running')"
_STORY_JOBS_TIMING = """
SELECT count(*) FILTER (WHERE status = 'completed'),
       coalesce(extract(epoch FROM max(completed_at) - min(started_at))::float8, 0)
FROM story_jobs
"""
_STORY_JOBS_PICKUP_MS = """
SELECT extract(epoch FROM started_at - created_at)::float8 * 1000
FROM story_jobs WHERE id = ANY (%(ids)s::bigint[]) OR public_id = ANY (%(public_ids)s::uuid[])
"""


class _StoryJobsTable(Queue):
    def enqueue_bulk(self, bench_db: BenchDatabase, count: int) -> None:
        bench_db.insert_pending(bench_db.create_client(), count)

    def unfinished(self, bench_db: BenchDatabase) -> int:
        return int(bench_db.scalar(_STORY_JOBS_UNFINISHED))

    def drain_timing(self, bench_db: BenchDatabase) -> DrainTiming:
        row = bench_db.reader.execute(_STORY_JOBS_TIMING).fetchone()
        assert row is not None
        return DrainTiming(int(row[0]), float(row[1]))

    def pickup_ms(self, bench_db: BenchDatabase, keys: list[Any]) -> list[float]:
        # the api answers with public ids, the bare enqueuer with internal ones
        ids = [key for key in keys if isinstance(key, int)]
        public_ids = [key for key in keys if not isinstance(key, int)]
        rows = bench_db.reader.execute(_STORY_JOBS_PICKUP_MS, {"ids": ids, "public_ids": public_ids}).fetchall()
        return [float(row[0]) for row in rows]


class StoryJobs(_StoryJobsTable):
    name = "storyjobs"
    title = "storyjobs"
    mode_one = "WORKER_CONCURRENCY=1"
    mode_batched = "WORKER_CONCURRENCY=10 (one statement settles and claims a round)"
    ready_app = WORKER_LISTEN_APP

    def start_workers(self, system: System, count: int, *, batched: bool, draining: bool) -> list[Proc]:
        env: dict[str, Any] = dict(drain.WORKER_ENV) if draining else {"OFFLINE_DELAY_S": 0}
        env["WORKER_CONCURRENCY"] = 10 if batched else 1
        return [system.worker(wait=False, **env) for _ in range(count)]

    def enqueuer(self, system: System, bench_db: BenchDatabase) -> Enqueuer:
        key = create_key_sync(bench_db.url, "bench")
        api = system.api(**API_ENV)
        return _ApiEnqueuer(api.base_url, key)


class _ApiEnqueuer(Enqueuer):
    """POST /stories/generate, as a client does; the NOTIFY is the api's."""

    def __init__(self, base_url: str, key: str) -> None:
        self._client = httpx.AsyncClient(base_url=base_url, timeout=10, headers={"Authorization": f"Bearer {key}"})

    async def __aexit__(self, *_: object) -> None:
        await self._client.aclose()

    async def enqueue(self) -> Any:
        answer = await self._client.post("/stories/generate", json={"prompt": "bench", "length": "short"},
                                         headers={"Idempotency-Key": str(uuid.uuid4())})
        if answer.status_code != 202:
            raise RuntimeError(f"POST /stories/generate answered {answer.status_code}: {answer.text[:300]}")
        return str(answer.json()["job_id"])


class BareLoop(_StoryJobsTable):
    name = "bare"
    title = "bare loop"
    mode_one = "claim one row, then complete it: two statements, two commits per job"
    mode_batched = "claim up to 10 rows, then complete them in one statement"
    ready_app = peer_apps.BARE_APPLICATION_NAME

    def start_workers(self, system: System, count: int, *, batched: bool, draining: bool) -> list[Proc]:
        return [system.start("bare", BARE_WORKER, "--batch", "10" if batched else "1") for _ in range(count)]

    def enqueuer(self, system: System, bench_db: BenchDatabase) -> Enqueuer:
        return _BareEnqueuer(bench_db)


class _BareEnqueuer(Enqueuer):
    """One INSERT and its NOTIFY in one statement, one commit."""

    _INSERT = f"""
    WITH job AS (
        INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, turn)
        VALUES (%(client_id)s, %(key)s, %(fingerprint)s, %(request)s::jsonb, 0)
        RETURNING id
    )
    SELECT id, pg_notify('{peer_apps.BARE_CHANNEL}', '') FROM job
    """

    def __init__(self, bench_db: BenchDatabase) -> None:
        self._url = bench_db.url
        self._params = {"client_id": bench_db.create_client(), "fingerprint": BENCH_FINGERPRINT,
                        "request": BENCH_REQUEST_JSON}
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def __aenter__(self) -> Enqueuer:
        self._conn = await psycopg.AsyncConnection.connect(self._url, autocommit=True)
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._conn is not None:
            await self._conn.close()

    async def enqueue(self) -> Any:
        assert self._conn is not None
        cursor = await self._conn.execute(self._INSERT, {**self._params, "key": str(uuid.uuid4())})
        row = await cursor.fetchone()
        assert row is not None
        return row[0]


# -- pgqueuer ------------------------------------------------------------------------------------


class PgQueuer(Queue):
    name = "pgqueuer"
    title = "pgqueuer"
    mode_one = "batch size 1"
    mode_batched = "batch size 10 (its default)"
    ready_app = peer_apps.PGQUEUER_APPLICATION_NAME

    def __init__(self) -> None:
        self._template: str | None = None

    def missing(self) -> str | None:
        return _module_missing("pgqueuer", "asyncpg")

    def prepare(self, ctx: BenchContext) -> None:
        def install(url: str) -> None:
            _run_tool("pgq install", ["pgqueuer", "install"], _tool_env(url, PGDSN=as_uri(url)))

        self._template = ctx.create_template("pgqueuer", install)

    def template(self) -> str | None:
        return self._template

    def enqueue_bulk(self, bench_db: BenchDatabase, count: int) -> None:
        async def enqueue() -> None:
            import asyncpg
            from pgqueuer.db import AsyncpgDriver
            from pgqueuer.queries import Queries

            connection = await asyncpg.connect(as_uri(bench_db.url))
            try:
                await Queries(AsyncpgDriver(connection)).enqueue(
                    [peer_apps.PGQUEUER_ENTRYPOINT] * count, [None] * count, [0] * count)
            finally:
                await connection.close()

        asyncio.run(enqueue())
        _vacuum_analyze(bench_db, "pgqueuer", "pgqueuer_log")

    def start_workers(self, system: System, count: int, *, batched: bool, draining: bool) -> list[Proc]:
        args = ["--batch-size", "10" if batched else "1"]
        return [system.start("pgqueuer", PGQUEUER_WORKER, *args, PGQUEUER_BENCH_DSN=as_uri(system.database_url))
                for _ in range(count)]

    def unfinished(self, bench_db: BenchDatabase) -> int:
        # a finished job leaves the queue table (its log rows stay)
        return int(bench_db.scalar("SELECT count(*) FROM pgqueuer"))

    def drain_timing(self, bench_db: BenchDatabase) -> DrainTiming:
        row = bench_db.reader.execute("""
            SELECT count(*) FILTER (WHERE status = 'successful'),
                   coalesce(extract(epoch FROM max(created) FILTER (WHERE status = 'successful')
                                          - min(created) FILTER (WHERE status = 'picked'))::float8, 0)
            FROM pgqueuer_log
        """).fetchone()
        assert row is not None
        return DrainTiming(int(row[0]), float(row[1]))

    def enqueuer(self, system: System, bench_db: BenchDatabase) -> Enqueuer:
        return _PgQueuerEnqueuer(as_uri(bench_db.url))

    def pickup_ms(self, bench_db: BenchDatabase, keys: list[Any]) -> list[float]:
        rows = bench_db.reader.execute("""
            SELECT extract(epoch FROM picked.created - queued.created)::float8 * 1000
            FROM pgqueuer_log queued
            JOIN pgqueuer_log picked ON picked.job_id = queued.job_id AND picked.status = 'picked'
            WHERE queued.status = 'queued' AND queued.job_id = ANY (%(ids)s)
        """, {"ids": keys}).fetchall()
        return [float(row[0]) for row in rows]


class _PgQueuerEnqueuer(Enqueuer):
    """Queries.enqueue on one asyncpg connection; pgqueuer's insert trigger NOTIFYs."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._connection: Any = None
        self._queries: Any = None

    async def __aenter__(self) -> Enqueuer:
        import asyncpg
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.queries import Queries

        self._connection = await asyncpg.connect(self._dsn)
        self._queries = Queries(AsyncpgDriver(self._connection))
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._connection is not None:
            await self._connection.close()

    async def enqueue(self) -> Any:
        (job_id,) = await self._queries.enqueue(peer_apps.PGQUEUER_ENTRYPOINT, None)
        return int(job_id)


# -- procrastinate --------------------------------------------------------------------------------


class Procrastinate(Queue):
    name = "procrastinate"
    title = "procrastinate"
    mode_one = "procrastinate worker --concurrency 1"
    mode_batched = "procrastinate worker --concurrency 10"
    ready_app = peer_apps.PROCRASTINATE_APPLICATION_NAME

    def __init__(self) -> None:
        self._template: str | None = None

    def missing(self) -> str | None:
        return _module_missing("procrastinate")

    def prepare(self, ctx: BenchContext) -> None:
        def install(url: str) -> None:
            _run_tool("procrastinate schema --apply",
                      ["procrastinate", "--app", PROCRASTINATE_APP, "schema", "--apply"], _tool_env(url))

        self._template = ctx.create_template("procrastinate", install)

    def template(self) -> str | None:
        return self._template

    def enqueue_bulk(self, bench_db: BenchDatabase, count: int) -> None:
        async def enqueue() -> None:
            from tests.bench.peer_apps import procrastinate_app

            app = procrastinate_app.make_app(bench_db.url)
            async with app.open_async():
                await app.tasks[peer_apps.PROCRASTINATE_TASK].batch_defer_async(*([{}] * count))

        asyncio.run(enqueue())
        _vacuum_analyze(bench_db, "procrastinate_jobs", "procrastinate_events")

    def start_workers(self, system: System, count: int, *, batched: bool, draining: bool) -> list[Proc]:
        args = ["--app", PROCRASTINATE_APP, "--log-level", "warning", "worker",
                "--concurrency", "10" if batched else "1"]
        return [system.start("procrastinate", "procrastinate", *args) for _ in range(count)]

    def unfinished(self, bench_db: BenchDatabase) -> int:
        return int(bench_db.scalar("SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"))

    def drain_timing(self, bench_db: BenchDatabase) -> DrainTiming:
        row = bench_db.reader.execute("""
            SELECT count(*) FILTER (WHERE type = 'succeeded'),
                   coalesce(extract(epoch FROM max(at) FILTER (WHERE type = 'succeeded')
                                          - min(at) FILTER (WHERE type = 'started'))::float8, 0)
            FROM procrastinate_events
        """).fetchone()
        assert row is not None
        return DrainTiming(int(row[0]), float(row[1]))

    def enqueuer(self, system: System, bench_db: BenchDatabase) -> Enqueuer:
        return _ProcrastinateEnqueuer(bench_db.url)

    def pickup_ms(self, bench_db: BenchDatabase, keys: list[Any]) -> list[float]:
        rows = bench_db.reader.execute("""
            SELECT extract(epoch FROM started.at - deferred.at)::float8 * 1000
            FROM procrastinate_events deferred
            JOIN procrastinate_events started ON started.job_id = deferred.job_id AND started.type = 'started'
            WHERE deferred.type = 'deferred' AND deferred.job_id = ANY (%(ids)s)
        """, {"ids": keys}).fetchall()
        return [float(row[0]) for row in rows]


class _ProcrastinateEnqueuer(Enqueuer):
    """Task.defer_async through procrastinate's connector; its trigger NOTIFYs."""

    def __init__(self, url: str) -> None:
        from tests.bench.peer_apps import procrastinate_app

        self._app = procrastinate_app.make_app(url)
        self._opened: Any = None

    async def __aenter__(self) -> Enqueuer:
        self._opened = self._app.open_async()
        await self._opened.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._opened is not None:
            await self._opened.__aexit__(None, None, None)

    async def enqueue(self) -> Any:
        return await self._app.tasks[peer_apps.PROCRASTINATE_TASK].defer_async()


# storyjobs first, then its peers, then the floor: the order of every round
QUEUES: list[Queue] = [StoryJobs(), PgQueuer(), Procrastinate(), BareLoop()]
