"""history: what a month of finished jobs costs every screen and every pass.

Two databases on one private Postgres, measured in the same run: one empty,
one loaded with HISTORY_JOBS finished jobs (default 300,000; quick: 30,000)
spread evenly over the last 30 days, as an operator's database looks after
a month: 1,000 clients, 95 % completed with a story of 2.5-4 kB (text that
compresses about as English does) and a billed ledger row, 5 % failed, every
job's idempotency key, a delivered webhook for the jobs of a fifth of the
clients, and the rollup's last eight days. Both then VACUUM ANALYZE as
autovacuum would have, and are migrated again (`storyjobs migrate` keeps the
database's settings).

The private server is Debian's Postgres 15 (initdb as `postgres`, its own
port and data directory) with autovacuum on and JIT available, as operators
run it; the shared test server runs with autovacuum off, and the embedded
Postgres cannot JIT-compile. Without Debian's binaries the run uses the test
server and says so.

On each database, one api process (no worker: the jobs posted stay pending
for the claim that follows), then, in turn:

* POST /stories/generate, one after the other, new keys: p50 and p99, and
  what the server did meanwhile (_ServerWork): the blocks a POST's
  statements read from outside shared buffers, by relation, and the time
  they waited for them (track_io_timing is on in the private server); the
  WAL written; the autovacuums, ANALYZEs and checkpoints;
* GET of a job (the poll): p50 and p99;
* the worker's claim and settle statements, one job a round, on a
  connection set up as a worker's: mean of each;
* the console's endpoints (overview, workers, clients, a week's history, the
  jobs list's first page): p50 and p99;
* the clients screen's counts over yesterday, a whole UTC day (the screen
  reads today, which holds as much only late in the day): p50 and p99;
* `storyjobs stats` in-process (a connection, the same reads): median;
* a sweeper pass with nothing to prune: median;
* admission after an ANALYZE taken while 2,000 jobs waited (then drained
  before the next ANALYZE): POST p50 and p99, of as many POSTs as the POST
  figure (of 100, the p99 was the second slowest: little more than the one
  admission per connection that plans anew after any ANALYZE);
* a day's prune: every job finished 29-30 days ago, batch by batch as the
  sweeper deletes them (JOB_RETENTION_S of 29 days), then the partition of
  their stories dropped (the loaded stories are in one partition a day, as
  the sweeper keeps them; sweeper/partitions.py), the time it took and
  the database's size before and after (and after a VACUUM of its tables),
  the blocks read meanwhile, the time they took and the autovacuums, and
  each table's size before and the space it gave back (parameters
  prune_day_space_empty / _loaded);
  then, with LEDGER_RETENTION_S of 29 days, the same day's ledger rows, batch
  by batch as the sweeper deletes them (their jobs now gone): the time;
* the next day: as many finished jobs as a day of the history, added after
  that prune (and the VACUUM autovacuum would run after it), and the
  database's growth over its size before the prune, by table too (parameters
  next_day_space_empty / _loaded): whether the next day fits in the space
  the day's prune made, where the empty database shows a day's own size.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, TypeVar

import httpx
import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from shared import db, keys
from shared.config import SweeperSettings
from shared.console_store import ConsoleStore
from shared.queries import QUERIES
from shared.ratelimit import NO_LIMITS, claim_params
from shared.store import job_id_bounds
from sweeper.__main__ import run as sweeper_loop
from sweeper.store import PgSweeperStore
from sweeper.sweep import PRUNE_BATCHES_PER_PASS, Sweeper
from tests.bench.harness import (
    BENCH_FINGERPRINT,
    BENCH_REQUEST_JSON,
    BenchContext,
    BenchDatabase,
    BenchResult,
    FigureSpec,
    percentile,
)
from tests.support import postgres_server, private_postgres, worker_statements
from tests.support.database import pages_read
from worker.rows import ClaimedJob, Completion

NAME = "history"
DAY = 86_400
STATES = ("empty", "loaded")
CONSOLE = {
    "overview": ("/ops/api/overview", {}),
    "workers": ("/ops/api/workers", {}),
    "clients": ("/ops/api/clients", {}),
    "history_week": ("/ops/api/history", {"range": "week"}),
    "jobs": ("/ops/api/jobs", {"limit": 50}),
}
_FIGURES: list[tuple[str, str, str]] = [
    ("post_p50_ms", "POST /stories/generate, p50", "ms"),
    ("post_p99_ms", "POST /stories/generate, p99", "ms"),
    ("poll_p50_ms", "GET /stories/jobs/{id} (the poll), p50", "ms"),
    ("poll_p99_ms", "GET /stories/jobs/{id} (the poll), p99", "ms"),
    ("post_blocks_read", "blocks a POST's statements read from outside shared buffers, mean", "blocks"),
    ("post_read_ms", "time a POST's statements spent reading those blocks (track_io_timing), mean", "ms"),
    ("post_wal_kb", "WAL written while the POSTs ran, a POST's share", "kB"),
    ("claim_mean_ms", "the claim statement, one job, mean", "ms"),
    ("settle_mean_ms", "the settle statement, one job, mean", "ms"),
    *[(f"{name}_{p}_ms", f"GET {path}{' ' + str(params) if params else ''}, {p}", "ms")
      for name, (path, params) in CONSOLE.items() for p in ("p50", "p99")],
    ("clients_whole_day_p50_ms", "the clients screen's counts of a whole UTC day (yesterday's), p50", "ms"),
    ("clients_whole_day_p99_ms", "the clients screen's counts of a whole UTC day (yesterday's), p99", "ms"),
    ("stats_ms", "`storyjobs stats` (connect and read), median", "ms"),
    ("sweep_ms", "a sweeper pass, nothing to prune, median", "ms"),
    ("post_after_backlog_p50_ms", "POST after an ANALYZE taken under a 2,000-job backlog, p50", "ms"),
    ("post_after_backlog_p99_ms", "POST after an ANALYZE taken under a 2,000-job backlog, p99", "ms"),
    ("claim_before_snapshot_p99_ms", "claim (with its settle) p99, before a snapshot is held", "ms"),
    ("claim_held_snapshot_p99_ms", "claim p99 while one snapshot is held open (HISTORY_SNAPSHOT_S)", "ms"),
    ("claim_held_snapshot_last_p99_ms", "claim p99 in the held snapshot's last 10 s", "ms"),
    ("claim_after_snapshot_p99_ms", "claim p99 50-60 s after the snapshot's release", "ms"),
    ("claim_buffers_before_snapshot", "buffers one claim reads (EXPLAIN ANALYZE), before the snapshot", "pages"),
    ("claim_buffers_held_snapshot", "buffers one claim reads, at the held snapshot's end", "pages"),
    ("claim_buffers_after_snapshot", "buffers one claim reads, 60 s after the snapshot's release", "pages"),
    ("prune_day_s", "a day's prune (jobs finished 29-30 days ago), all batches", "s"),
    ("prune_day_jobs", "jobs that day's prune deleted", "jobs"),
    ("prune_day_story_partitions", "partitions of stories that day's prune dropped", "partitions"),
    ("prune_day_blocks_read", "blocks read from outside shared buffers in the database during that prune "
     "(its statements and any autovacuum meanwhile)", "blocks"),
    ("prune_day_read_s", "time those reads took (track_io_timing)", "s"),
    ("prune_day_autovacuums", "autovacuums of the database's tables during that prune", "runs"),
    ("ledger_prune_day_s", "the ledger's day (LEDGER_RETENTION_S of 29 days, after the jobs' prune), all batches",
     "s"),
    ("ledger_prune_day_rows", "ledger rows that day's ledger prune deleted", "rows"),
    ("size_before_prune_mb", "database size before the day's prune", "MB"),
    ("size_after_prune_mb", "database size after the day's prune", "MB"),
    ("size_after_vacuum_mb", "database size after the prune and a VACUUM", "MB"),
    ("size_after_next_day_mb", "database size once the next day's jobs are added (a thirtieth of the history's)",
     "MB"),
    ("next_day_growth_mb", "the database's growth from before the prune to after the next day's jobs", "MB"),
]
SPECS: dict[str, FigureSpec] = {
    f"{state}.{key}": FigureSpec(f"{state}: {label}", unit) for state in STATES for key, label, unit in _FIGURES
}
SPECS["load_s"] = FigureSpec("loading the history (INSERT ... SELECT, then VACUUM ANALYZE)", "s")
SHARED_BUFFERS = "256MB"
BACKLOG = 2_000
# each measure alternates this many blocks between the two databases
BLOCKS = 5
T = TypeVar("T")


def run(ctx: BenchContext, result: BenchResult) -> None:
    jobs = int(os.environ.get("HISTORY_JOBS", "30000" if ctx.quick else "300000"))
    posts = 60 if ctx.quick else 300
    console_requests = 20 if ctx.quick else 60
    result.params.update({"history_jobs": jobs, "days": 30, "clients": 1000, "posts_per_state": posts,
                          "console_requests_per_endpoint": console_requests, "backlog": BACKLOG,
                          "blocks": BLOCKS})
    with _server(result) as server_url:
        for run_number in range(1, ctx.runs + 1):
            databases: dict[str, BenchDatabase] = {}
            try:
                for state in STATES:
                    name = f"storyjobs_history_{state}_{os.getpid()}_{run_number}"
                    databases[state] = BenchDatabase(server_url, name,
                                                     postgres_server.create_migrated_database(server_url, name))
                started = time.monotonic()
                _load(databases["loaded"].url, jobs)
                result.add("load_s", time.monotonic() - started)
                for bench_db in databases.values():
                    asyncio.run(_rollup_pass(bench_db.url))
                result.params[f"table_mb_run_{run_number}"] = _table_sizes_mb(databases["loaded"].url)
                ctx.progress(f"history: {jobs:,} finished jobs loaded in {time.monotonic() - started:.0f} s, "
                             f"{_size_mb(databases['loaded'].url):,.0f} MB")
                figures = _measure(ctx, result, databases, posts=posts, console_requests=console_requests,
                                   day_jobs=max(1, jobs // 30))
                for state, measured in figures.items():
                    for key, value in measured.items():
                        result.add(f"{state}.{key}", value)
                    ctx.progress(f"history run {run_number}/{ctx.runs} {state}: " + ", ".join(
                        f"{key} {value:,.1f}" for key, value in measured.items()))
            finally:
                for bench_db in databases.values():
                    bench_db.close()
                    postgres_server.drop_database(server_url, bench_db.name)


# -- the private server ------------------------------------------------------------


def _bindir() -> str | None:
    """Debian's Postgres 15 server binaries, else the newest this machine has."""
    found = private_postgres.server_bindirs()
    found.sort(key=lambda path: path != "/usr/lib/postgresql/15/bin")
    return found[0] if found else None


@contextlib.contextmanager
def _server(result: BenchResult) -> Iterator[str]:
    bindir = _bindir()
    if bindir is None:
        with postgres_server.server_url() as url:
            result.note("Debian's Postgres binaries not found: measured on the test server (its own autovacuum "
                        "and JIT settings), not on a private Postgres 15")
            result.params["server"] = "the test server"
            yield url
        return
    # track_io_timing: how long the statements waited on reads, in pg_stat_database (_ServerWork)
    settings = {"autovacuum": "on", "shared_buffers": SHARED_BUFFERS, "max_connections": "100", "jit": "on",
                "track_io_timing": "on"}
    result.params["server"] = {"binaries": bindir, **settings}
    with private_postgres.private_server(bindir, settings=settings) as server:
        with psycopg.connect(server.url) as conn:
            row = conn.execute("SELECT version(), pg_jit_available()").fetchone()
        assert row is not None
        result.params["server"]["version"] = row[0]
        result.params["server"]["jit_available"] = row[1]
        yield server.url


# -- the history -------------------------------------------------------------------


def _load(url: str, jobs: int, *, story_ranges: bool = True) -> None:
    """``jobs`` finished jobs evenly over the last 30 days (the newest 5 minutes ago), with what each leaves
    behind, their stories in a range a day (``story_ranges``) or in the one table of a database before
    migration 029; then VACUUM ANALYZE, and the migration's settings kept."""
    with psycopg.connect(url, autocommit=True) as conn:
        _clients(conn)
        if story_ranges:
            _story_ranges_by_day(conn, jobs)
        _add_finished_jobs(conn, count=jobs, span_s=30 * DAY)
        # the rollup the sweeper would have kept: eight days of minutes
        conn.execute(
            """
            INSERT INTO minute_rollup (minute, completed, failed, cancelled, spend_usd, pending_max, running_max,
                                       wait_counts, run_counts)
            SELECT m, c, c / 19, 0, c * 0.0051, 3, 5, array_fill(0, ARRAY[23]), array_fill(0, ARRAY[23])
            FROM generate_series(date_trunc('minute', now()) - interval '8 days',
                                 date_trunc('minute', now()) - interval '1 minute', interval '1 minute') AS m,
                 LATERAL (SELECT greatest(1, %(jobs)s / (30 * 1440)) AS c) AS per_minute
            """, {"jobs": jobs})
        conn.execute("VACUUM ANALYZE")
        conn.execute("CHECKPOINT")


def _clients(conn: psycopg.Connection[Any]) -> None:
    """The history's 1,000 clients, with a webhook endpoint for each fifth, where not made yet."""
    conn.execute("INSERT INTO api_clients (name) SELECT 'history-' || g FROM generate_series(1, 1000) g "
                 "ON CONFLICT (name) DO NOTHING")
    conn.execute("INSERT INTO webhook_endpoints (client_id, url, events, secret) "
                 "SELECT c.id, 'https://hooks.example.com/' || c.id, '{job.completed,job.failed}', 'whsec_x' "
                 "FROM api_clients c WHERE c.id % 5 = 0 "
                 "AND NOT EXISTS (SELECT 1 FROM webhook_endpoints e WHERE e.client_id = c.id)")


def _add_finished_jobs(conn: psycopg.Connection[Any], *, count: int, span_s: float) -> None:
    """``count`` finished jobs evenly over the ``span_s`` before 5 minutes ago, with their stories, keys, billed
    ledger rows and, for the clients with a webhook endpoint, a delivered webhook each. Their keys are numbered
    from the table's next id: past every history job's, whose number is at most its id."""
    row = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM story_jobs").fetchone()
    assert row is not None
    first_id = row[0]
    # the jobs just added, by id: written out only where the table held jobs before, so that the load's
    # statements and plans stay those of a table holding nothing else
    added = sql.SQL("") if first_id == 1 else sql.SQL("AND j.id >= {}").format(first_id)
    conn.execute(
        """
        INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, status,
                                error_code, error_text, story_id, worker_id, progress, model,
                                max_tokens, worst_case_usd, charged_usd,
                                created_at, started_at, heartbeat_at, completed_at)
        SELECT 1 + n %% 1000, 'history-' || n, %(fingerprint)s, %(request)s::jsonb,
               CASE WHEN n %% 20 = 0 THEN 'failed' ELSE 'completed' END::job_status,
               CASE WHEN n %% 20 = 0 THEN 'llm_error' END,
               CASE WHEN n %% 20 = 0 THEN 'the LLM call failed' END,
               CASE WHEN n %% 20 = 0 THEN NULL ELSE gen_random_uuid() END,
               'worker-' || n %% 20, 900, 'claude-sonnet-5-5', 4000, 0.0406, 0.0051,
               t.finished - interval '100 seconds', t.finished - interval '90 seconds',
               t.finished - interval '5 seconds', t.finished
        FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS n,
             LATERAL (SELECT now() - interval '5 minutes'
                             - make_interval(secs => (%(last)s - n) * (%(span_s)s - 300) / %(count)s)
                             AS finished) AS t
        ORDER BY n
        """,
        {"fingerprint": BENCH_FINGERPRINT, "request": BENCH_REQUEST_JSON, "first": first_id,
         "last": first_id + count - 1, "count": count, "span_s": span_s})
    conn.execute(sql.SQL(
        """
        INSERT INTO stories (id, job_id, client_id, title, body, model, prompt_version, input_tokens,
                             output_tokens, cost_usd, created_at)
        SELECT j.story_id, j.id, j.client_id, 'The Fox and the Moon',
               (SELECT string_agg(md5(j.id::text || '-' || g), ' ') FROM generate_series(1, 76 + j.id % 45) g),
               'claude-sonnet-5-5', 'v1', 300, 900, 0.0051, j.completed_at
        -- the jobs in id order first, the texts made after: sorted with
        -- their texts, 10M stories spilled 30 GB of temporary files
        FROM (SELECT j.id, j.story_id, j.client_id, j.completed_at FROM story_jobs j
              WHERE j.status = 'completed' {added} ORDER BY j.id OFFSET 0) j
        """).format(added=added))
    conn.execute(sql.SQL("INSERT INTO job_idempotency_keys (client_id, idempotency_key, job_id) "
                         "SELECT j.client_id, j.idempotency_key, j.id FROM story_jobs j WHERE true {added} ORDER BY j.id")
                 .format(added=added))
    conn.execute(sql.SQL(
        """
        INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model, started_at, finished_at, outcome,
                               billed, input_tokens, output_tokens, cost_usd, worst_case_usd, request_id)
        SELECT id, 1, worker_id, 'anthropic', 'claude-sonnet-5-5', started_at, completed_at,
               CASE WHEN status = 'failed' THEN 'failed' ELSE 'succeeded' END, true, 300, 900, 0.0051,
               0.0406, 'req_' || id
        FROM story_jobs j WHERE true {added} ORDER BY j.id
        """).format(added=added))
    conn.execute(sql.SQL(
        """
        INSERT INTO webhook_deliveries (endpoint_id, client_id, job_id, job_public_id, job_status, story_id,
                                        occurred_at, created_at, state, attempts, next_attempt_at,
                                        last_attempt_at, last_status_code, delivered_at)
        SELECT e.id, j.client_id, j.id, j.public_id, j.status, j.story_id, j.completed_at, j.completed_at,
               'delivered', 1, j.completed_at, j.completed_at, 200, j.completed_at + interval '1 second'
        FROM story_jobs j JOIN webhook_endpoints e ON e.client_id = j.client_id
        WHERE true {added} ORDER BY j.id
        """).format(added=added))


def _story_ranges_by_day(conn: psycopg.Connection[Any], jobs: int) -> None:
    """The stories' partitions as the sweeper keeps them (sweeper/partitions.py) after 30 days: one range a
    day of jobs, and two ahead of the next id; stories_unranged bounded below them, empty."""
    width = max(1, jobs // 30)
    conn.execute(QUERIES["stories_unranged_bound"], {"bound": 1})
    conn.execute(QUERIES["stories_unranged_validate"])
    for lo in range(1, jobs + 1 + 2 * width, width):
        conn.execute(QUERIES["story_partition_add"], {"lo": lo, "hi": lo + width})


async def _rollup_pass(url: str) -> None:
    """The rollup's pass, as the sweeper that runs beside the console keeps it: the first recounts the last 25
    hours (the loaded rows hold no overview columns), so that the overview sums the day from the rollup."""
    async with await db.connect(url, application_name="storyjobs-sweeper", connect_timeout_s=30,
                                generic_plans=True) as conn:
        await PgSweeperStore(conn).record_minutes(_sweeper_settings(url, 31 * DAY), pending=0, running=0)


def _table_sizes_mb(url: str) -> dict[str, float]:
    """The history's eight largest tables with their indexes and TOAST, then its eight largest indexes (an
    index a POST inserts into at a random place reads a page of it from outside shared buffers once it has
    outgrown them)."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "(SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c "
            " JOIN pg_namespace n ON n.oid = c.relnamespace "
            " WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') ORDER BY 2 DESC LIMIT 8) "
            "UNION ALL (SELECT c.relname, pg_relation_size(c.oid) FROM pg_class c "
            " JOIN pg_namespace n ON n.oid = c.relnamespace "
            " WHERE n.nspname = 'public' AND c.relkind = 'i' ORDER BY 2 DESC LIMIT 8)").fetchall()
    return {name: round(size / 1e6, 1) for name, size in rows}


def _space_by_table_mb(url: str) -> dict[str, float]:
    """Each table's size with its indexes and TOAST, the stories' partitions as one: what a prune gives back
    by table, and what it leaves (space VACUUM makes reusable, none returned)."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT CASE WHEN c.relispartition AND p.inhparent = 'stories'::regclass THEN 'stories' "
            "            ELSE c.relname END, sum(pg_total_relation_size(c.oid)) "
            "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "LEFT JOIN pg_inherits p ON p.inhrelid = c.oid "
            "WHERE n.nspname = 'public' AND c.relkind = 'r' GROUP BY 1").fetchall()
    return {name: float(size) / 1e6 for name, size in rows}


def _size_mb(url: str) -> float:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT pg_database_size(current_database())").fetchone()
    assert row is not None
    return float(row[0]) / 1e6


# -- the measures ------------------------------------------------------------------


@dataclass
class _Keys:
    client: str
    operator: str


async def _keys(url: str) -> _Keys:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return _Keys(client=(await keys.create(conn, "history-bench")).key,
                     operator=(await keys.create_operator(conn, "history-bench")).key)


def _measure(ctx: BenchContext, result: BenchResult, databases: dict[str, BenchDatabase], *, posts: int,
             console_requests: int, day_jobs: int) -> dict[str, dict[str, float]]:
    """Every measure in blocks that alternate between the empty and the loaded database, so that what else the
    machine does at the time weighs on both alike."""
    figures: dict[str, dict[str, float]] = {state: {} for state in STATES}
    made = {state: asyncio.run(_keys(bench_db.url)) for state, bench_db in databases.items()}
    urls = {state: bench_db.url for state, bench_db in databases.items()}
    with contextlib.ExitStack() as stack:
        clients: dict[str, httpx.Client] = {}
        for state, bench_db in databases.items():
            system = stack.enter_context(ctx.processes(bench_db))
            api = system.api(QUEUE_MAX=1_000_000, API_STATEMENT_TIMEOUT_S=30)
            clients[state] = stack.enter_context(httpx.Client(base_url=api.base_url, timeout=30))
        per_block = max(1, posts // BLOCKS)
        with _ServerWork.during(urls) as work:
            posted = _alternating(lambda state: work.of(state, lambda: _post(clients[state], made[state].client,
                                                                              per_block)))
        _percentiles(figures, "post", {state: [ms for ms, _ in got] for state, got in posted.items()})
        for state, done in work.done.items():
            count = len(posted[state])
            figures[state].update({"post_blocks_read": done.blocks_read / count,
                                   "post_read_ms": done.read_ms / count,
                                   "post_wal_kb": done.wal_bytes / count / 1000})
            result.params[f"post_server_work_{state}"] = done.detail()
        locations = {state: got[-1][1] for state, got in posted.items()}
        _percentiles(figures, "poll", _alternating(lambda state: _timed(
            lambda: clients[state].get(locations[state], headers=_bearer(made[state].client)), per_block)))
        worked = _alternating(lambda state: asyncio.run(_claim_and_settle(urls[state], max(2, per_block - 2))))
        for state, rounds in worked.items():
            figures[state]["claim_mean_ms"] = statistics.mean(ms for kind, ms in rounds if kind == "claim")
            figures[state]["settle_mean_ms"] = statistics.mean(ms for kind, ms in rounds if kind == "settle")
        for name, (path, params) in CONSOLE.items():
            _percentiles(figures, name, _alternating(lambda state, path=path, params=params: _timed(  # type: ignore[misc]
                lambda: clients[state].get(path, params=params, headers=_bearer(made[state].operator)),
                max(1, console_requests // BLOCKS), warmup=2)))
        # the clients screen reads today, which holds more jobs the later it is: over yesterday, its
        # statement reads what it reads at the end of a day, whatever the hour the bench runs
        _percentiles(figures, "clients_whole_day", _alternating(lambda state: asyncio.run(
            _clients_whole_day(urls[state], max(1, console_requests // BLOCKS)))))
        for state, measured in _alternating(lambda state: asyncio.run(_stats(urls[state], 2))).items():
            figures[state]["stats_ms"] = statistics.median(measured)
        for state, measured in _alternating(lambda state: asyncio.run(_sweeps(urls[state], 1))).items():
            figures[state]["sweep_ms"] = statistics.median(measured)
        for url in urls.values():
            _analyze_under_a_backlog(url)
        after = _alternating(lambda state: _post(clients[state], made[state].client, per_block,
                                                 prefix="after-backlog"))
        _percentiles(figures, "post_after_backlog", {state: [ms for ms, _ in got] for state, got in after.items()})
    # quick (CI's smoke test): every stretch measured, briefly; the claim
    # loops keep both cores busy while they run
    held_s = float(os.environ.get("HISTORY_SNAPSHOT_S", "4" if ctx.quick else "90"))
    pending = int(os.environ.get("HISTORY_SNAPSHOT_PENDING", "30000" if ctx.quick else "100000"))
    through = asyncio.run(_claims_through_a_held_snapshot(
        urls, held_s=held_s, before_s=4 if ctx.quick else 30, after_s=8 if ctx.quick else 60, pending=pending))
    for state, stretches in through.items():
        figures[state].update(stretches)
    for state, url in urls.items():
        pruned, space = asyncio.run(_prune_a_day(url))
        figures[state].update(pruned)
        result.params[f"prune_day_space_{state}"] = space
        next_day, grown = _next_day(url, day_jobs, pruned["size_before_prune_mb"], space)
        figures[state].update(next_day)
        result.params[f"next_day_space_{state}"] = grown
    return figures


async def _claims_through_a_held_snapshot(urls: dict[str, str], *, held_s: float, before_s: float,
                                          after_s: float, pending: int) -> dict[str, dict[str, float]]:
    """On both databases at once: a worker's claim and settle, one job a round, without pause, before, while
    and after one session holds a snapshot open (REPEATABLE READ, idle in its transaction) for ``held_s``;
    autovacuum does what it does, and the sweeper runs its loop as deployed (a pass every SWEEPER_INTERVAL_S,
    and the claim's floor, migration 030, raised between passes at HEARTBEAT_INTERVAL_S). The claim's p99 in
    each stretch."""
    for url in urls.values():
        with psycopg.connect(url, autocommit=True) as conn:
            _add_pending(conn, pending, tag="snapshot", first_turn=1e9)
            conn.execute("VACUUM ANALYZE story_jobs")
    start = time.monotonic()
    release = before_s + held_s
    end = release + after_s

    async def work(url: str) -> list[tuple[float, float]]:
        timed: list[tuple[float, float]] = []
        conn = await db.connect(url, application_name="storyjobs-worker", connect_timeout_s=30,
                                generic_plans=True)
        async with conn:
            while time.monotonic() - start < end:
                began = time.perf_counter()
                claimed = await worker_statements.job_claim(conn, worker_id="snapshot-bench", claim_limit=1,
                                                       provider="p", model="m")
                timed.append((time.monotonic() - start, (time.perf_counter() - began) * 1000))
                if not claimed.claimed:
                    raise RuntimeError("the held-snapshot run ran out of pending jobs: raise "
                                       "HISTORY_SNAPSHOT_PENDING")
                await worker_statements.job_settle(conn, worker_id="snapshot-bench", completions=[
                    Completion(job_id=job.id, client_id=job.client_id, attempt=1, title="The Fox",
                               body="Once upon a time. " * 150, model="m", prompt_version="v1",
                               input_tokens=300, output_tokens=900, cost_usd=Decimal("0.0051"),
                               request_id="req_bench") for job in claimed.claimed], model="m")
        return timed

    async def sweep(url: str) -> None:
        """The sweeper's own loop (sweeper/__main__.py), its default intervals."""
        stop = asyncio.Event()
        async with _sweeper_pool(url) as pool:
            loop = asyncio.create_task(sweeper_loop(Sweeper(_sweeper_settings(url, 31 * DAY), PgSweeperStore(pool)),
                                                    stop))
            await asyncio.sleep(max(0.0, end - (time.monotonic() - start)))
            stop.set()
            await loop

    async def hold(url: str) -> None:
        await asyncio.sleep(before_s)
        async with await psycopg.AsyncConnection.connect(url) as holder:
            await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            await holder.execute("SELECT count(*) FROM api_clients")
            await asyncio.sleep(held_s)
            await holder.rollback()

    async def buffers(url: str) -> list[float]:
        """What one claim reads, in pages, just before the snapshot, before its release and at the end: the
        dead entries of the live-jobs indexes that it walks past, which only VACUUM's index cleanup removes.
        Each claim is rolled back."""
        read: list[float] = []
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as probe:
            for at in (before_s - 2, release - 2, end - 2):
                await asyncio.sleep(max(0.0, at - (time.monotonic() - start)))
                read.append(float(await pages_read(probe, "job_claim", {
                    **claim_params(NO_LIMITS, None, default_max_tokens=4000), "worker_id": "probe",
                    "claim_limit": 1, "provider": "p", "model": "m"})))
        return read

    states = list(urls)
    worked = asyncio.gather(*(work(urls[state]) for state in states))
    probed = asyncio.gather(*(buffers(urls[state]) for state in states))
    await asyncio.gather(worked, probed, *(hold(urls[state]) for state in states),
                         *(sweep(urls[state]) for state in states))
    figures: dict[str, dict[str, float]] = {}
    for state, timed, read in zip(states, worked.result(), probed.result(), strict=True):

        def p99(since: float, until: float, timed: list[tuple[float, float]] = timed) -> float:
            return percentile([ms for at, ms in timed if since <= at < until], 99)

        figures[state] = {
            "claim_before_snapshot_p99_ms": p99(0, before_s),
            "claim_held_snapshot_p99_ms": p99(before_s, release),
            "claim_held_snapshot_last_p99_ms": p99(release - min(10, held_s), release),
            "claim_after_snapshot_p99_ms": p99(end - min(10, after_s), end),
            "claim_buffers_before_snapshot": read[0],
            "claim_buffers_held_snapshot": read[1],
            "claim_buffers_after_snapshot": read[2],
        }
    return figures


def _alternating(measure: Callable[[str], list[T]]) -> dict[str, list[T]]:
    """BLOCKS blocks of ``measure`` for each state in turn."""
    got: dict[str, list[T]] = {state: [] for state in STATES}
    for _ in range(BLOCKS):
        for state in STATES:
            got[state].extend(measure(state))
    return got


def _percentiles(figures: dict[str, dict[str, float]], name: str, measured: dict[str, list[float]]) -> None:
    for state, values in measured.items():
        figures[state][f"{name}_p50_ms"], figures[state][f"{name}_p99_ms"] = _p50_p99(values)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _p50_p99(values: list[float]) -> tuple[float, float]:
    return percentile(values, 50), percentile(values, 99)


def _timed(request: Any, count: int, *, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        request().raise_for_status()
    measured = []
    for _ in range(count):
        started = time.perf_counter()
        answer = request()
        measured.append((time.perf_counter() - started) * 1000)
        answer.raise_for_status()
    return measured


@dataclass
class _ServerWork:
    """What a database's server did while a measure ran on it: the blocks its statements read from outside
    shared buffers (the OS's cache or the disk) and the time they waited for them, by relation; the WAL
    written; the autovacuums and ANALYZEs that ran and the checkpoints taken meanwhile. What a latency's
    tail was spent on, where the figure alone cannot say."""

    blocks_read: float = 0
    read_ms: float = 0
    wal_bytes: float = 0
    by_relation: dict[str, float] = field(default_factory=dict)
    maintenance: dict[str, float] = field(default_factory=dict)
    checkpoints: float = 0

    def detail(self) -> dict[str, Any]:
        busiest = sorted(self.by_relation.items(), key=lambda item: -item[1])[:6]
        return {"blocks_read_by_relation": {name: blocks for name, blocks in busiest if blocks},
                "autovacuum_and_analyze": {name: runs for name, runs in self.maintenance.items() if runs},
                "checkpoints": self.checkpoints}

    @staticmethod
    @contextlib.contextmanager
    def during(urls: dict[str, str]) -> Iterator[_Stretch]:
        stretch = _Stretch(urls)
        before = {state: _server_counters(url) for state, url in urls.items()}
        yield stretch
        # a backend reports its statistics when idle, at most once a second
        time.sleep(2)
        for state, url in urls.items():
            stretch.done[state].add(before[state], _server_counters(url))

    def add(self, before: dict[str, Any], after: dict[str, Any]) -> None:
        """What the server did between two readings of _server_counters (the WAL aside)."""
        self.blocks_read += after["blocks_read"] - before["blocks_read"]
        self.read_ms += after["read_ms"] - before["read_ms"]
        self.checkpoints += after["checkpoints"] - before["checkpoints"]
        for name, count in after["relations"].items():
            self.by_relation[name] = self.by_relation.get(name, 0) + count - before["relations"].get(name, 0)
        for name, count in after["maintenance"].items():
            self.maintenance[name] = self.maintenance.get(name, 0) + count - before["maintenance"].get(name, 0)


class _Stretch:
    def __init__(self, urls: dict[str, str]) -> None:
        self.urls = urls
        self.done = {state: _ServerWork() for state in urls}

    def of(self, state: str, measure: Callable[[], list[T]]) -> list[T]:
        """``measure``, on ``state``'s database alone: the WAL the server wrote meanwhile is its own."""
        started = _wal_lsn(self.urls[state])
        got = measure()
        self.done[state].wal_bytes += _wal_lsn(self.urls[state]) - started
        return got


def _wal_lsn(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


def _server_counters(url: str) -> dict[str, Any]:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT d.blks_read, d.blk_read_time, b.checkpoints_timed + b.checkpoints_req "
            "FROM pg_stat_database d, pg_stat_bgwriter b WHERE d.datname = current_database()").fetchone()
        relations = conn.execute(
            "SELECT relname, coalesce(heap_blks_read, 0) + coalesce(toast_blks_read, 0) FROM pg_statio_user_tables "
            "UNION ALL SELECT indexrelname, idx_blks_read FROM pg_statio_user_indexes").fetchall()
        maintenance = conn.execute(
            "SELECT relname || ' autovacuum', autovacuum_count FROM pg_stat_user_tables "
            "UNION ALL SELECT relname || ' autoanalyze', autoanalyze_count FROM pg_stat_user_tables").fetchall()
    assert row is not None
    return {"blocks_read": float(row[0]), "read_ms": float(row[1]), "checkpoints": float(row[2]),
            "relations": {name: float(count) for name, count in relations},
            "maintenance": {name: float(count) for name, count in maintenance}}


def _post(client: httpx.Client, key: str, count: int, *, prefix: str = "post") -> list[tuple[float, str]]:
    """``count`` new jobs, one after the other: each one's latency and Location."""
    answers = []
    stamp = time.monotonic_ns()
    for n in range(count):
        started = time.perf_counter()
        answer = client.post("/stories/generate", json={"prompt": "a fox who cannot sleep", "length": "short"},
                             headers={**_bearer(key), "Idempotency-Key": f"{prefix}-{stamp}-{n}"})
        elapsed = (time.perf_counter() - started) * 1000
        if answer.status_code != 202:
            raise RuntimeError(f"POST answered {answer.status_code}: {answer.text[:300]}")
        answers.append((elapsed, answer.headers["Location"]))
    return answers


async def _claim_and_settle(url: str, rounds: int) -> list[tuple[str, float]]:
    """The worker's two statements, one job a round, on a connection set up as a worker's (generic plans):
    each one's time in ms, but the first of each (which plans it)."""
    conn = await db.connect(url, application_name="storyjobs-worker", connect_timeout_s=30, generic_plans=True)
    timed: list[tuple[str, float]] = []
    async with conn:
        held: list[ClaimedJob] = []
        for round_number in range(rounds + 1):
            if held:
                started = time.perf_counter()
                await worker_statements.job_settle(conn, worker_id="history-bench", completions=[
                    Completion(job_id=job.id, client_id=job.client_id, attempt=1, title="The Fox",
                               body="Once upon a time. " * 150, model="m", prompt_version="v1", input_tokens=300,
                               output_tokens=900, cost_usd=Decimal("0.0051"), request_id="req_bench")
                    for job in held], model="m")
                if round_number > 1:
                    timed.append(("settle", (time.perf_counter() - started) * 1000))
            if round_number == rounds:
                break
            started = time.perf_counter()
            claimed = await worker_statements.job_claim(conn, worker_id="history-bench", claim_limit=1, provider="p",
                                                   model="m")
            if round_number > 0:
                timed.append(("claim", (time.perf_counter() - started) * 1000))
            held = claimed.claimed
            if not held:
                raise RuntimeError("the claim found no pending job: post more jobs than rounds")
    return timed


async def _clients_whole_day(url: str, count: int, *, warmup: int = 2) -> list[float]:
    """The clients screen's counts of a day (each client's jobs and failures) over yesterday, UTC, as the
    console reads today's: from the day's first id."""
    day_start = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(days=1)
    measured = []
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        bounds = await job_id_bounds(conn, created_after=day_start, created_before=None)
        clients = ConsoleStore(conn).clients
        for n in range(warmup + count):
            started = time.perf_counter()
            await clients.ops_client_today(from_id=bounds.lo_id, day_start=day_start)
            if n >= warmup:
                measured.append((time.perf_counter() - started) * 1000)
    return measured


async def _stats(url: str, count: int) -> list[float]:
    """`storyjobs stats` as the command runs it (its own connection, its reads, its printing), in-process."""
    from tools import cli

    os.environ["DATABASE_URL"] = url
    measured = []
    for _ in range(count):
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            await cli.cmd_stats(None)  # type: ignore[arg-type]
        measured.append((time.perf_counter() - started) * 1000)
    return measured


def _sweeper_pool(url: str) -> AsyncConnectionPool:
    """One connection, as the sweeper's pool makes them."""
    return db.make_pool(url, application_name="storyjobs-sweeper", connect_timeout_s=30, statement_timeout_s=60,
                        min_size=1, max_size=1, wait_timeout_s=30, generic_plans=True)


def _sweeper_settings(url: str, retention_s: float, ledger_retention_s: float | None = None) -> SweeperSettings:
    return SweeperSettings(database_url=url, job_retention_s=retention_s, ledger_retention_s=ledger_retention_s,
                           metrics_port=0)


async def _sweeps(url: str, count: int) -> list[float]:
    """Sweeper passes as the sweeper's pool runs them, retention past the oldest job: nothing to prune."""
    measured = []
    async with _sweeper_pool(url) as pool:
        sweeper = Sweeper(_sweeper_settings(url, 31 * DAY), PgSweeperStore(pool))
        await sweeper.sweep_once()
        for _ in range(count):
            started = time.perf_counter()
            await sweeper.sweep_once()
            measured.append((time.perf_counter() - started) * 1000)
    return measured


def _add_pending(conn: psycopg.Connection[Any], jobs: int, *, tag: str, first_turn: float) -> None:
    """``jobs`` pending jobs of the 1,000 clients, keyed ``tag-n``, in turn after ``first_turn``."""
    conn.execute(
        "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, turn) "
        "SELECT 1 + n %% 1000, %(tag)s || '-' || n, %(fingerprint)s, %(request)s::jsonb, %(first_turn)s + n "
        "FROM generate_series(1, %(jobs)s) AS n",
        {"fingerprint": BENCH_FINGERPRINT, "request": BENCH_REQUEST_JSON, "jobs": jobs, "tag": tag,
         "first_turn": float(first_turn)})


def _analyze_under_a_backlog(url: str) -> None:
    """2,000 jobs wait while ANALYZE runs, then a drain ends them before the next ANALYZE."""
    with psycopg.connect(url, autocommit=True) as conn:
        _add_pending(conn, BACKLOG, tag="backlog", first_turn=0)
        conn.execute("ANALYZE story_jobs")
        conn.execute("UPDATE story_jobs SET status = 'failed', error_code = 'cancelled', error_text = 'drained', "
                     "completed_at = now() WHERE idempotency_key LIKE 'backlog-%' AND status = 'pending'")
        conn.execute("UPDATE job_admission SET pending_at_most = 0")


async def _prune_a_day(url: str) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The jobs finished 29-30 days ago, deleted by the sweeper's own prune, pass after pass with no wait between
    (PRUNE_BATCHES_PER_PASS batches of 500 each), until one finds nothing left; then the ledger rows of that
    day, by the sweeper's own ledger prune with LEDGER_RETENTION_S of 29 days, likewise. With the figures, each
    table's size before both prunes and the space it gave back."""
    settings = _sweeper_settings(url, 29 * DAY, ledger_retention_s=29 * DAY)
    a_whole_pass = PRUNE_BATCHES_PER_PASS * settings.sweeper_batch_size
    before = _size_mb(url)
    tables_before = _space_by_table_mb(url)
    pruned = 0
    counted = _server_counters(url)
    async with await db.connect(url, application_name="storyjobs-sweeper", connect_timeout_s=30,
                                generic_plans=True) as conn:
        store = PgSweeperStore(conn)
        sweeper = Sweeper(settings, store)
        started = time.perf_counter()
        # a pass that deleted less than its batches could found the walk's end
        deleted = a_whole_pass
        while deleted == a_whole_pass:
            deleted = await sweeper.prune_finished()
            pruned += deleted
        # and the day's stories, dropped with their partition
        dropped = (await store.keep_story_partitions(retention_s=settings.job_retention_s)).dropped
        elapsed = time.perf_counter() - started
    # the prune's backend has reported its statistics as it ended
    await asyncio.sleep(1)
    work = _ServerWork()
    work.add(counted, _server_counters(url))
    async with await db.connect(url, application_name="storyjobs-sweeper", connect_timeout_s=30,
                                generic_plans=True) as conn:
        sweeper = Sweeper(settings, PgSweeperStore(conn))
        ledger_started = time.perf_counter()
        ledger_rows = 0
        deleted = a_whole_pass
        while deleted == a_whole_pass:
            deleted = await sweeper.prune_ledger()
            ledger_rows += deleted
        ledger_elapsed = time.perf_counter() - ledger_started
    after = _size_mb(url)
    tables_after = _space_by_table_mb(url)
    space = {table: {"mb": round(mb, 1), "back_mb": round(mb - tables_after.get(table, 0.0), 1)}
             for table, mb in sorted(tables_before.items(), key=lambda item: -item[1]) if mb >= 0.1}
    with psycopg.connect(url, autocommit=True) as conn:
        for table in ("story_jobs", "stories", "job_idempotency_keys", "webhook_deliveries", "llm_calls"):
            conn.execute(f"VACUUM {table}")
    return {"prune_day_s": elapsed, "prune_day_jobs": pruned, "prune_day_story_partitions": dropped,
            "prune_day_blocks_read": work.blocks_read, "prune_day_read_s": work.read_ms / 1000,
            "prune_day_autovacuums": sum(runs for name, runs in work.maintenance.items()
                                         if name.endswith(" autovacuum")),
            "ledger_prune_day_s": ledger_elapsed, "ledger_prune_day_rows": ledger_rows,
            "size_before_prune_mb": before,
            "size_after_prune_mb": after, "size_after_vacuum_mb": _size_mb(url)}, space


def _next_day(url: str, jobs: int, size_before_prune_mb: float,
              tables_before: dict[str, dict[str, float]]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The next day's ``jobs`` finished jobs (a day of the history's), added once the prune is done and its
    tables vacuumed, as autovacuum does after it: the database's size then and its growth over its size before
    the prune, and each table's (``tables_before``: _prune_a_day's space by table). On the loaded database the
    day takes the space the prune made; on the empty one, what a day takes where there is none."""
    with psycopg.connect(url, autocommit=True) as conn:
        _clients(conn)
        _add_finished_jobs(conn, count=jobs, span_s=DAY)
    size = _size_mb(url)
    grown = {table: {"mb": round(mb, 1), "grown_mb": round(mb - tables_before.get(table, {}).get("mb", 0.0), 1)}
             for table, mb in sorted(_space_by_table_mb(url).items(), key=lambda item: -item[1]) if mb >= 0.1}
    return {"size_after_next_day_mb": size, "next_day_growth_mb": size - size_before_prune_mb}, grown
