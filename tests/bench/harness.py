"""What every benchmark shares: fresh databases, the processes under test,
bulk seeding, the database's own counters, and the figures a benchmark
reports (median, min and max of its runs)."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import psycopg
import psycopg.sql
from psycopg.conninfo import conninfo_to_dict

from shared.story_request import StoryRequest, canonical_json, fingerprint
from tests.support import postgres_server
from tests.system.procs import Proc, System, wait_while_running

REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "tests" / "bench" / "results"

# every bulk-inserted job asks for the same short story
BENCH_REQUEST = StoryRequest(prompt="bench", length="short")
BENCH_REQUEST_JSON = canonical_json(BENCH_REQUEST).decode()
BENCH_FINGERPRINT = fingerprint(BENCH_REQUEST)

# the worker's application_name on its LISTEN connection: one per live worker
WORKER_LISTEN_APP = "storyjobs-worker-listen"

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


# -- figures ---------------------------------------------------------------------


def percentile(values: Iterable[float], pct: float) -> float:
    """Nearest-rank percentile: the smallest value with pct % of values at or below it."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class FigureSpec:
    label: str
    unit: str
    # False: in the JSON, left out of the Markdown summary table (a benchmark
    # that renders its own section shows it there)
    in_table: bool = True


@dataclass
class Figure:
    label: str
    unit: str
    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def as_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "unit": self.unit,
            "median": self.median,
            "min": min(self.samples),
            "max": max(self.samples),
            "samples": self.samples,
        }


@dataclass
class BenchResult:
    """One benchmark's figures (one sample per run), its parameters and notes."""

    name: str
    specs: dict[str, FigureSpec]
    samples: dict[str, list[float]] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    def add(self, key: str, value: float) -> None:
        if key not in self.specs:
            raise KeyError(f"{self.name} has no figure {key!r}")
        self.samples.setdefault(key, []).append(float(value))

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def figures(self) -> dict[str, Figure]:
        return {
            key: Figure(spec.label, spec.unit, self.samples[key])
            for key, spec in self.specs.items()
            if self.samples.get(key)
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "figures": {key: figure.as_json() for key, figure in self.figures().items()},
            "params": self.params,
            "notes": self.notes,
            "error": self.error,
        }


# -- databases and processes ---------------------------------------------------------


class BenchDatabase:
    """A fresh migrated database of one benchmark run, and the reads and bulk
    writes benchmarks make on it directly (the code under test never does)."""

    def __init__(self, server_url: str, name: str, url: str) -> None:
        self.server_url = server_url
        self.name = name
        self.url = url
        # the one connection the harness polls on: a new connection per poll
        # would cost the server a backend start each time
        self._reader: psycopg.Connection[Any] | None = None

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, autocommit=True)

    @property
    def reader(self) -> psycopg.Connection[Any]:
        if self._reader is None or self._reader.closed:
            self._reader = self.connect()
        return self._reader

    def reader_pid(self) -> int | None:
        return None if self._reader is None or self._reader.closed else self._reader.info.backend_pid

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def scalar(self, query: str, params: dict[str, Any] | None = None) -> Any:
        row = self.reader.execute(query, params).fetchone()
        assert row is not None
        return row[0]

    def create_client(self, name: str = "bench") -> int:
        return int(self.scalar(
            "INSERT INTO api_clients (name) VALUES (%(name)s) "
            "ON CONFLICT (name) DO UPDATE SET name = excluded.name RETURNING id",
            {"name": name},
        ))

    def insert_pending(self, client_id: int, count: int, *, notify: bool = False) -> None:
        """count pending jobs in one statement (bulk, as a backlog would be),
        then VACUUM ANALYZE as autovacuum would have; with notify, wakes the
        listening workers as the api's insert does."""
        with self.connect() as conn:
            conn.execute(
                """
                INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, turn)
                SELECT %(client_id)s, 'pending-' || n, %(fingerprint)s, %(request)s::jsonb, n
                FROM generate_series(1, %(count)s) AS n
                """,
                {"client_id": client_id, "fingerprint": BENCH_FINGERPRINT, "request": BENCH_REQUEST_JSON,
                 "count": count},
            )
            conn.execute("VACUUM ANALYZE story_jobs")
            if notify:
                conn.execute("NOTIFY storyjobs_pending")

    def insert_finished(self, client_id: int, count: int) -> None:
        """count finished jobs (19 completed to 1 failed), finished 1.5 s apart
        and ending an hour ago: history well inside the retention period, so a
        sweeper pass prunes none of it. Completed rows get a random story_id
        (the CHECK wants one; the stories themselves are not needed)."""
        with self.connect() as conn:
            conn.execute(
                """
                INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, status,
                                        error_code, error_text, story_id, worker_id, progress,
                                        created_at, started_at, heartbeat_at, completed_at)
                SELECT %(client_id)s, 'finished-' || n, %(fingerprint)s, %(request)s::jsonb,
                       CASE WHEN n %% 20 = 0 THEN 'failed' ELSE 'completed' END::job_status,
                       CASE WHEN n %% 20 = 0 THEN 'llm_error' END,
                       CASE WHEN n %% 20 = 0 THEN 'the LLM call failed' END,
                       CASE WHEN n %% 20 = 0 THEN NULL ELSE gen_random_uuid() END,
                       'bench-history', 450,
                       t.finished - interval '70 seconds', t.finished - interval '65 seconds',
                       t.finished - interval '5 seconds', t.finished
                FROM generate_series(1, %(count)s) AS n,
                     LATERAL (SELECT now() - interval '1 hour'
                                     - make_interval(secs => (%(count)s - n) * 1.5) AS finished) AS t
                """,
                {"client_id": client_id, "fingerprint": BENCH_FINGERPRINT, "request": BENCH_REQUEST_JSON,
                 "count": count},
            )

    def unfinished(self) -> int:
        return int(self.scalar("SELECT count(*) FROM story_jobs WHERE status IN ('pending', 'running')"))

    def count_status(self, status: str) -> int:
        return int(self.scalar("SELECT count(*) FROM story_jobs WHERE status = %(status)s::job_status",
                               {"status": status}))

    def wait_until(self, what: str, check: Callable[[], bool], procs: list[Proc], *, timeout_s: float,
                   interval_s: float = 0.2) -> None:
        """Polls check() until true; fails early if a process under test died."""
        wait_while_running(check, procs, what=what, timeout=timeout_s, interval=interval_s)

    def wait_drained(self, procs: list[Proc], *, timeout_s: float) -> None:
        self.wait_until("the queue to drain", lambda: self.unfinished() == 0, procs,
                        timeout_s=timeout_s, interval_s=0.1)

    def wait_workers_listening(self, procs: list[Proc], count: int, *, timeout_s: float = 60.0) -> None:
        """A worker opens its LISTEN connection once it runs its loop: that is
        our readiness signal (its "worker.started" line is info, and the
        benchmarks log at warning)."""
        self.wait_until(
            f"{count} workers to listen",
            lambda: self.connections(WORKER_LISTEN_APP) >= count,
            procs, timeout_s=timeout_s,
        )

    def connections(self, application_name: str) -> int:
        with postgres_server.admin(self.server_url) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
                (self.name, application_name),
            ).fetchone()
        assert row is not None
        return int(row[0])


class DatabaseCounters:
    """The database's own counters, read over a connection to the maintenance
    database so that reading them adds nothing to the benchmark database's."""

    def __init__(self, server_url: str, dbname: str) -> None:
        self.dbname = dbname
        self._conn = postgres_server.admin(server_url)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> DatabaseCounters:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def transactions(self) -> int:
        """Committed plus rolled-back transactions of the benchmark database:
        with autocommit connections, one per statement. Backends publish their
        counts when they go idle, at most once a second (up to 10 s late for a
        backend that then stays idle), so a window should be tens of seconds."""
        self._conn.execute("SELECT pg_stat_clear_snapshot()")
        row = self._conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", (self.dbname,)
        ).fetchone()
        assert row is not None
        return int(row[0])

    def activity(self) -> tuple[int, int]:
        """(transactions, rows written: inserted + updated + deleted) of the
        benchmark database so far; see transactions() on when backends
        publish them (a backend that exits publishes at once)."""
        self._conn.execute("SELECT pg_stat_clear_snapshot()")
        row = self._conn.execute(
            "SELECT xact_commit + xact_rollback, tup_inserted + tup_updated + tup_deleted "
            "FROM pg_stat_database WHERE datname = %s", (self.dbname,)
        ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def statements_view_loaded(self) -> bool:
        row = self._conn.execute("SHOW shared_preload_libraries").fetchone()
        return row is not None and "pg_stat_statements" in row[0]

    def backend_pids(self, *, excluding: int | None = None) -> list[int]:
        rows = self._conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend'",
            (self.dbname,),
        ).fetchall()
        return [int(row[0]) for row in rows if row[0] != excluding]


class StatementCounter:
    """Statements the benchmark database executed: pg_stat_statements calls
    when the server preloads it (the extension is created in the benchmark
    database, and the counter's own reads are left out by their text), else
    transactions (see DatabaseCounters.transactions)."""

    _OWN_READ = "/* bench statement counter */"

    def __init__(self, bench_db: BenchDatabase, counters: DatabaseCounters) -> None:
        self._counters = counters
        self._bench_conn: psycopg.Connection[Any] | None = None
        self.method = "transactions"
        if counters.statements_view_loaded():
            self._bench_conn = bench_db.connect()
            self._bench_conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            self.method = "pg_stat_statements"

    def close(self) -> None:
        if self._bench_conn is not None:
            self._bench_conn.close()

    def __enter__(self) -> StatementCounter:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def description(self) -> str:
        if self.method == "pg_stat_statements":
            return "counted with pg_stat_statements (calls in the benchmark database, minus the counter's own reads)"
        return ("counted as transactions (pg_stat_statements is not preloaded): xact_commit + xact_rollback "
                "of the benchmark database, read from the maintenance database")

    def count(self) -> int:
        if self._bench_conn is None:
            return self._counters.transactions()
        row = self._bench_conn.execute(
            self._OWN_READ + " SELECT coalesce(sum(calls), 0) FROM pg_stat_statements "
            "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND query NOT LIKE %s",
            (f"%{self._OWN_READ}%",),
        ).fetchone()
        assert row is not None
        return int(row[0])


def as_uri(conninfo: str) -> str:
    """A postgresql:// URI for a libpq connection string, for clients that
    take only URIs (asyncpg). A socket directory goes in the query string."""
    params = {key: str(value) for key, value in conninfo_to_dict(conninfo).items()}
    user = quote(params.pop("user", ""), safe="")
    password = params.pop("password", None)
    credentials = f"{user}:{quote(password, safe='')}@" if password else (f"{user}@" if user else "")
    host = params.pop("host", "")
    port = params.pop("port", "")
    if host.startswith("/"):
        params["host"] = host
        host = ""
    netloc = f"{credentials}{host}{':' + port if port and host else ''}"
    if port and not host:
        params["port"] = port
    dbname = quote(params.pop("dbname", ""), safe="")
    query = f"?{urlencode(params)}" if params else ""
    return f"postgresql://{netloc}/{dbname}{query}"


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a local process, or None when it is gone or not ours
    to see (a Postgres in a container has pids from another namespace)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    # fields after the command: state is 3rd in proc(5), so utime (14th) is index 11
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S


def is_postgres_process(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() in {"postgres", "postmaster"}
    except OSError:
        return False


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_SIZE


class BenchContext:
    """The run's server, its migrated template database, and where logs go.
    Every database made here is dropped by ``close()``."""

    def __init__(self, server_url: str, *, runs: int, quick: bool, log_root: Path, verbose: bool) -> None:
        self.server_url = server_url
        self.runs = runs
        self.quick = quick
        self.verbose = verbose
        self.log_root = log_root
        self.prefix = f"storyjobs_bench_{os.getpid()}"
        self.template = f"{self.prefix}_template"
        self._counter = itertools.count(1)
        self._created: list[str] = []
        postgres_server.create_migrated_database(server_url, self.template)
        self._created.append(self.template)

    def close(self) -> None:
        for name in reversed(self._created):
            postgres_server.drop_database(self.server_url, name)
        self._created.clear()

    def progress(self, message: str) -> None:
        if self.verbose:
            sys.stderr.write(f"bench: {message}\n")
            sys.stderr.flush()

    @contextlib.contextmanager
    def database(self, label: str, *, template: str | None = None) -> Iterator[BenchDatabase]:
        """A fresh database, dropped at the end: a copy of the migrated
        template, or of the given one."""
        bench_db = self.create_database(label, template=template)
        try:
            yield bench_db
        finally:
            self.drop_database(bench_db)

    def create_database(self, label: str, *, template: str | None = None) -> BenchDatabase:
        name = f"{self.prefix}_{label}_{next(self._counter)}"
        self._created.append(name)
        url = postgres_server.create_database_from_template(self.server_url, name, template or self.template)
        return BenchDatabase(self.server_url, name, url)

    def create_template(self, label: str, install: Callable[[str], None]) -> str:
        """An empty database that install(url) fills, to copy fresh databases
        from: another system's schema, installed once by its own tooling.
        Dropped by ``close()``; returns its name."""
        name = f"{self.prefix}_{label}_template"
        postgres_server.drop_database(self.server_url, name)
        with postgres_server.admin(self.server_url) as conn:
            conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
        self._created.append(name)
        install(postgres_server.with_dbname(self.server_url, name))
        return name

    def drop_database(self, bench_db: BenchDatabase) -> None:
        bench_db.close()
        postgres_server.drop_database(self.server_url, bench_db.name)
        if bench_db.name in self._created:
            self._created.remove(bench_db.name)

    @contextlib.contextmanager
    def processes(self, bench_db: BenchDatabase, **env: Any) -> Iterator[System]:
        """The processes of one run (logging at warning, metrics off); all
        stopped at the end, SIGTERM then SIGKILL."""
        log_dir = self.log_root / bench_db.name.removeprefix(f"{self.prefix}_")
        log_dir.mkdir(parents=True, exist_ok=True)
        settings = {"LOG_LEVEL": "warning", "METRICS_PORT": "0", **{k: str(v) for k, v in env.items()}}
        system = System(bench_db.url, log_dir, **settings)
        try:
            yield system
        finally:
            system.stop_all()
