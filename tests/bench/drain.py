"""drain: how fast worker processes empty a backlog of instant jobs.

The backlog is bulk-inserted first, then the workers start (offline writer
with no delay): jobs/s = completed jobs / (last completed_at - first
started_at), by the database's clock, so process start-up is not counted.

Where the time goes, per job: the CPU of the workers' Postgres backends, the
CPU of the worker processes less what a worker spends starting up (measured
on a worker with nothing to do), and how many jobs one claiming statement
carried (the jobs it claimed share its transaction's now() as started_at).
"""

from __future__ import annotations

import statistics
import time

from tests.bench.harness import BenchContext, BenchResult, DatabaseCounters, FigureSpec, cpu_seconds

NAME = "drain"
# (worker processes, WORKER_CONCURRENCY)
COMBINATIONS = [(1, 1), (1, 10), (4, 1), (4, 10)]
SPECS: dict[str, FigureSpec] = {}
for _procs, _concurrency in COMBINATIONS:
    SPECS[f"procs{_procs}_conc{_concurrency}"] = FigureSpec(f"{_procs} proc × conc {_concurrency}", "jobs/s")
for _procs, _concurrency in COMBINATIONS:
    SPECS[f"procs{_procs}_conc{_concurrency}_db_cpu_ms_per_job"] = FigureSpec(
        f"{_procs} proc × conc {_concurrency}: Postgres backend CPU per job", "ms")
    SPECS[f"procs{_procs}_conc{_concurrency}_worker_cpu_ms_per_job"] = FigureSpec(
        f"{_procs} proc × conc {_concurrency}: worker process CPU per job", "ms")
    SPECS[f"procs{_procs}_conc{_concurrency}_jobs_per_claim"] = FigureSpec(
        f"{_procs} proc × conc {_concurrency}: jobs per claiming statement", "jobs")
SPECS["procs4_start_spread_ms"] = FigureSpec("4 procs: first claim of the last worker, after the first", "ms")

WORKER_ENV = {"OFFLINE_DELAY_S": 0, "WORKER_POLL_INTERVAL_S": 0.2}

_TIMING = """
SELECT count(*) FILTER (WHERE status = 'completed') AS completed,
       count(*) FILTER (WHERE status = 'failed') AS failed,
       extract(epoch FROM max(completed_at) - min(started_at))::float8 AS span_s,
       (SELECT extract(epoch FROM max(first) - min(first))::float8
        FROM (SELECT min(started_at) AS first FROM story_jobs GROUP BY worker_id) w) AS start_spread_s,
       -- the jobs one statement claims share its transaction's now()
       count(*)::float8 / count(DISTINCT (worker_id, started_at)) AS jobs_per_claim
FROM story_jobs
"""


def run(ctx: BenchContext, result: BenchResult) -> None:
    jobs = 500 if ctx.quick else 5000
    startup_cpu_s = _worker_startup_cpu_s(ctx)
    result.params.update({"jobs": jobs, "combinations": COMBINATIONS, "worker_env": WORKER_ENV,
                          "worker_startup_cpu_s": round(startup_cpu_s, 3)})
    for run_number in range(1, ctx.runs + 1):
        for procs, concurrency in COMBINATIONS:
            rate = _drain_once(ctx, result, jobs=jobs, procs=procs, concurrency=concurrency,
                               startup_cpu_s=startup_cpu_s)
            ctx.progress(f"drain run {run_number}/{ctx.runs}: {procs} proc × conc {concurrency}: "
                         f"{rate:,.0f} jobs/s")


def _worker_startup_cpu_s(ctx: BenchContext) -> float:
    """CPU a worker spends from exec to its idle loop (imports, connections)."""
    samples = []
    for _ in range(2):
        with ctx.database("drain_startup") as bench_db, ctx.processes(bench_db, **WORKER_ENV) as system:
            worker = system.worker(wait=False)
            bench_db.wait_workers_listening([worker], 1)
            time.sleep(0.5)
            samples.append(cpu_seconds(worker.pid) or 0.0)
    return statistics.median(samples)


def _drain_once(ctx: BenchContext, result: BenchResult, *, jobs: int, procs: int, concurrency: int,
                startup_cpu_s: float) -> float:
    with ctx.database("drain") as bench_db:
        client_id = bench_db.create_client()
        bench_db.insert_pending(client_id, jobs)
        with ctx.processes(bench_db, WORKER_CONCURRENCY=concurrency, **WORKER_ENV) as system:
            workers = [system.worker(wait=False) for _ in range(procs)]
            bench_db.wait_drained(workers, timeout_s=60 + jobs / 20)
            worker_cpu_s = sum(cpu_seconds(worker.pid) or 0.0 for worker in workers)
            with DatabaseCounters(bench_db.server_url, bench_db.name) as counters:
                backends = counters.backend_pids(excluding=bench_db.reader_pid())
            backend_cpu = [cpu_seconds(pid) for pid in backends]
        row = bench_db.reader.execute(_TIMING).fetchone()
    assert row is not None
    completed, failed, span_s, start_spread_s, jobs_per_claim = row
    if failed:
        result.note(f"{failed} of {jobs} jobs failed in a {procs} × {concurrency} run")
    rate: float = completed / span_s
    key = f"procs{procs}_conc{concurrency}"
    result.add(key, rate)
    result.add(f"{key}_jobs_per_claim", jobs_per_claim)
    result.add(f"{key}_worker_cpu_ms_per_job", max(worker_cpu_s - procs * startup_cpu_s, 0.0) / jobs * 1000)
    if backend_cpu and all(cpu is not None for cpu in backend_cpu):
        result.add(f"{key}_db_cpu_ms_per_job", sum(cpu or 0.0 for cpu in backend_cpu) / jobs * 1000)
    else:
        result.note("Postgres backend CPU not measured: the backends are not local processes")
    if procs > 1:
        result.add(f"procs{procs}_start_spread_ms", start_spread_s * 1000)
    return rate
