"""in flight behind a pooler: 2,000 jobs running at once across 20 worker
processes whose pools go through PgBouncer in transaction mode.

20 workers × WORKER_CONCURRENCY 100 stream from the fake provider (its own
process; 60 s streams of 60 chunks) with the default heartbeat interval,
DATABASE_POOLER=transaction, and a PgBouncer (Debian's, tests/support/pgbouncer.py)
whose pool holds at most POOL_SIZE server connections.

The workers poll (WORKER_LISTEN=false, WORKER_POLL_INTERVAL_S=1) rather than
listen: LISTEN needs a session, so 20 listening workers would hold 20 direct
server connections of their own, beside the pooler's. A worker whose slots
are all taken does not poll; one with a free slot sends one claim statement
a second through the pool.

Figures:

* server connections: the most seen at once over the whole run (claims,
  window, drain): the pooler's server connections (SHOW POOLS) plus any
  direct connection of a worker (pg_stat_activity); and the most client
  connections the workers held at the pooler;
* idle, before any job: statements/s the 20 polling workers send, and the
  database CPU they cost;
* with all 2,000 jobs running, over a 30 s window: database CPU (utime +
  stime of the benchmark database's backends, /proc/<pid>/stat) and the
  pooler's CPU, as percentages of one core; statements/s (all heartbeats:
  every slot is taken, so nobody polls), counted by the pooler (SHOW STATS);
* worker RSS per job in flight: the workers' RSS at the end of the window
  minus their RSS when idle, divided by the jobs.

The jobs are then left to complete, which checks that the streams were real.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from tests.bench.harness import (
    BenchContext,
    BenchDatabase,
    BenchResult,
    DatabaseCounters,
    FigureSpec,
    cpu_seconds,
    is_postgres_process,
    rss_bytes,
)
from tests.support.database import AdminSampler
from tests.support.pgbouncer import PgBouncer
from tests.system.procs import Proc

NAME = "in_flight_pooler"
POOL_SIZE = 10
SPECS = {
    "jobs_running": FigureSpec("jobs running at once in the window", "jobs"),
    "server_connections_peak": FigureSpec("server connections, most at once over the run (pooler's + direct)",
                                          "conns"),
    "client_connections_peak": FigureSpec("workers' client connections at the pooler, most at once", "conns"),
    "idle_statements_per_s": FigureSpec("idle: statements/s the polling workers send", "stmt/s"),
    "idle_db_cpu_pct_of_core": FigureSpec("idle: database CPU of the polls", "% of a core"),
    "db_cpu_pct_of_core": FigureSpec("database CPU (backends of the benchmark database)", "% of a core"),
    "pooler_cpu_pct_of_core": FigureSpec("PgBouncer CPU", "% of a core"),
    "statements_per_s": FigureSpec("statements/s through the pooler (heartbeats)", "stmt/s"),
    "worker_rss_per_job_kib": FigureSpec("worker RSS per job in flight, above idle", "KiB"),
    "provider_cpu_pct_of_core": FigureSpec("fake provider CPU", "% of a core"),
    "jobs_completed": FigureSpec("jobs completed after the window", "jobs"),
}


def run(ctx: BenchContext, result: BenchResult) -> None:
    if ctx.quick:
        workers, concurrency, chunks, stream_s, idle_s, window_s, heartbeat_s = 4, 25, 15, 15.0, 4.0, 6.0, 2.0
    else:
        workers, concurrency, chunks, stream_s, idle_s, window_s, heartbeat_s = 20, 100, 60, 60.0, 10.0, 30.0, 10.0
    result.params.update({
        "worker_processes": workers, "worker_concurrency": concurrency, "jobs": workers * concurrency,
        "stream_chunks": chunks, "stream_s": stream_s, "idle_window_s": idle_s, "window_s": window_s,
        "heartbeat_interval_s": heartbeat_s, "pooler": "PgBouncer, pool_mode=transaction",
        "default_pool_size": POOL_SIZE, "worker_listen": False, "worker_poll_interval_s": 1,
    })
    for run_number in range(1, ctx.runs + 1):
        _once(ctx, result, workers=workers, concurrency=concurrency, chunks=chunks, stream_s=stream_s,
              idle_s=idle_s, window_s=window_s, heartbeat_s=heartbeat_s)
        ctx.progress(f"in flight behind a pooler, run {run_number}/{ctx.runs}: " + ", ".join(
            f"{key} {values[-1]:,.2f}" for key, values in result.samples.items()))
    if chunks != 60 or stream_s != 60.0:
        result.note(f"streams of {chunks} chunks over {stream_s:g} s (quick mode)")


class ConnectionPeaks(AdminSampler):
    """Samples, on a thread, the server connections of the benchmark database (the pooler's, from SHOW
    POOLS, plus direct ones of the workers, from pg_stat_activity) and the workers' client connections at
    the pooler (SHOW POOLS), keeping the most of each seen at once."""

    def __init__(self, bouncer: PgBouncer, bench_db: BenchDatabase, interval_s: float = 0.05) -> None:
        super().__init__(bench_db.server_url, interval_s)
        self._bouncer = bouncer
        self._bench_db = bench_db
        self.server = 0
        self.clients = 0

    def sample(self, conn: psycopg.Connection[Any]) -> None:
        pools = [row for row in self._bouncer.show("pools") if row["database"] == self._bench_db.name]
        if not pools:  # no client has asked for the database yet
            return
        (pool,) = pools
        through_pooler = sum(int(pool[column]) for column in
                             ("sv_active", "sv_idle", "sv_used", "sv_tested", "sv_login"))
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
            "AND application_name = 'storyjobs-worker-listen'", (self._bench_db.name,),
        ).fetchone()
        direct = int(row[0]) if row else 0
        self.server = max(self.server, through_pooler + direct)
        # PgBouncer 1.18 counts an idle client in cl_active
        self.clients = max(self.clients, int(pool["cl_active"]) + int(pool["cl_waiting"]))


def _queries(bouncer: PgBouncer, dbname: str) -> int:
    """Statements the pooler passed to the benchmark database so far (SHOW STATS total_query_count)."""
    (row,) = [row for row in bouncer.show("stats") if row["database"] == dbname]
    return int(row["total_query_count"])


def _cpu_of(pids: list[int]) -> dict[int, float | None]:
    return {pid: cpu_seconds(pid) for pid in pids}


def _used(before: dict[int, float | None], after: dict[int, float | None]) -> float:
    return sum((value or 0.0) - (before.get(pid) or 0.0) for pid, value in after.items())


def _measure_cpu(counters: DatabaseCounters, bench_db: BenchDatabase, window_s: float,
                 also: Callable[[], Any] | None = None) -> tuple[float, float, bool]:
    """Database CPU seconds of the benchmark database's backends over window_s, the window's length, and
    whether the backends could be measured (local processes)."""
    pids = counters.backend_pids(excluding=bench_db.reader_pid())
    before = _cpu_of(pids)
    opened = time.monotonic()
    time.sleep(window_s)
    if also is not None:
        also()
    elapsed = time.monotonic() - opened
    after = _cpu_of(counters.backend_pids(excluding=bench_db.reader_pid()))
    return _used(before, after), elapsed, all(is_postgres_process(pid) for pid in after)


def _once(ctx: BenchContext, result: BenchResult, *, workers: int, concurrency: int, chunks: int, stream_s: float,
          idle_s: float, window_s: float, heartbeat_s: float) -> None:
    jobs = workers * concurrency
    bouncer = PgBouncer(ctx.server_url, default_pool_size=POOL_SIZE, max_client_conn=workers * 4 + 50)
    try:
        with ctx.database("in_flight_pooler") as bench_db, ctx.processes(bench_db) as system, \
                ConnectionPeaks(bouncer, bench_db) as peaks:
            provider = Proc("fake-provider", "tests.bench.fake_provider",
                            {**system.env, "FAKE_PROVIDER_CHUNKS": str(chunks),
                             "FAKE_PROVIDER_STREAM_S": str(stream_s)},
                            system.log_dir / "fake-provider.log")
            system.procs.append(provider)
            listening = provider.wait_for_event("fake_provider.listening")
            env = {"ANTHROPIC_API_KEY": "test", "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{listening['port']}",
                   "DATABASE_URL": bouncer.url(bench_db.name), "DATABASE_POOLER": "transaction",
                   "WORKER_LISTEN": "false", "WORKER_POLL_INTERVAL_S": "1", "WORKER_CONCURRENCY": str(concurrency),
                   "HEARTBEAT_INTERVAL_S": str(heartbeat_s), "WORKER_SHUTDOWN_GRACE_S": "5"}
            procs = [system.worker(wait=False, **env) for _ in range(workers)]
            watched = [*procs, provider]
            # each worker's pool opens one connection at start: at the pooler, one client per worker
            bench_db.wait_until(f"{workers} workers to connect",
                                lambda: _worker_clients(bouncer, bench_db.name) >= workers, watched, timeout_s=120)
            time.sleep(2.0)
            idle_rss = sum(rss_bytes(proc.pid) for proc in procs)

            with DatabaseCounters(bench_db.server_url, bench_db.name) as counters:
                polls_before = _queries(bouncer, bench_db.name)
                idle_cpu, idle_elapsed, measurable = _measure_cpu(counters, bench_db, idle_s)
                result.add("idle_statements_per_s", (_queries(bouncer, bench_db.name) - polls_before) / idle_elapsed)
                if measurable:
                    result.add("idle_db_cpu_pct_of_core", idle_cpu / idle_elapsed * 100)

                client_id = bench_db.create_client()
                bench_db.insert_pending(client_id, jobs)
                bench_db.wait_until(f"{jobs} jobs running", lambda: bench_db.count_status("running") == jobs,
                                    watched, timeout_s=180)
                # past the claims' burst, and past the first heartbeat of every worker
                time.sleep(heartbeat_s + 1)

                statements_before = _queries(bouncer, bench_db.name)
                pooler_before = cpu_seconds(bouncer.pid)
                provider_before = cpu_seconds(provider.pid)
                busy_rss: list[int] = []
                used, elapsed, measurable = _measure_cpu(
                    counters, bench_db, window_s, also=lambda: busy_rss.append(sum(rss_bytes(p.pid) for p in procs)))
                statements_after = _queries(bouncer, bench_db.name)
                pooler_after = cpu_seconds(bouncer.pid)
                provider_after = cpu_seconds(provider.pid)
            running_after = bench_db.count_status("running")

            result.add("jobs_running", running_after)
            result.add("statements_per_s", (statements_after - statements_before) / elapsed)
            result.add("worker_rss_per_job_kib", (busy_rss[0] - idle_rss) / jobs / 1024)
            if measurable:
                result.add("db_cpu_pct_of_core", used / elapsed * 100)
            else:
                result.note("database CPU not measured: the Postgres backends are not local processes")
            if pooler_before is not None and pooler_after is not None:
                result.add("pooler_cpu_pct_of_core", (pooler_after - pooler_before) / elapsed * 100)
            if provider_before is not None and provider_after is not None:
                result.add("provider_cpu_pct_of_core", (provider_after - provider_before) / elapsed * 100)
            if running_after < jobs:
                result.note(f"only {running_after} of {jobs} jobs were still running at the end of a window")

            bench_db.wait_drained(watched, timeout_s=stream_s * 2 + 60)
            result.add("jobs_completed", bench_db.count_status("completed"))
            provider.stop()
        result.add("server_connections_peak", peaks.server)
        result.add("client_connections_peak", peaks.clients)
    finally:
        bouncer.stop()


def _worker_clients(bouncer: PgBouncer, dbname: str) -> int:
    return sum(1 for row in bouncer.show("clients")
               if row["database"] == dbname and row["application_name"] == "storyjobs-worker")
