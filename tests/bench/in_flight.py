"""in flight: what 1,000 jobs running at once cost the database and the workers.

10 worker processes × WORKER_CONCURRENCY 100 stream from the fake provider
(its own process on loopback; 60 s streams of 60 chunks) with the default
heartbeat interval. Once all 1,000 jobs are running (and 11 s later, so that
the claims' counters are published), over a 30 s window:

* database CPU: utime + stime of the Postgres backends of the benchmark
  database (/proc/<pid>/stat), as a percentage of one core;
* statements/s the database receives (all of them heartbeats: every slot is
  taken, so nobody claims);
* worker RSS per job in flight: the workers' RSS at the end of the window
  minus their RSS when idle, divided by the jobs;
* the fake provider's own CPU, to show whether it kept up.

The jobs are then left to complete, which checks that the streams were real.
"""

from __future__ import annotations

import time

from tests.bench.harness import (
    BenchContext,
    BenchResult,
    DatabaseCounters,
    FigureSpec,
    StatementCounter,
    cpu_seconds,
    is_postgres_process,
    rss_bytes,
)
from tests.system.procs import Proc

NAME = "in_flight"
SPECS = {
    "jobs_running": FigureSpec("jobs running at once in the window", "jobs"),
    "db_cpu_pct_of_core": FigureSpec("database CPU (backends of the benchmark database)", "% of a core"),
    "statements_per_s": FigureSpec("statements/s received (heartbeats)", "stmt/s"),
    "worker_rss_per_job_kib": FigureSpec("worker RSS per job in flight, above idle", "KiB"),
    "provider_cpu_pct_of_core": FigureSpec("fake provider CPU", "% of a core"),
    "jobs_completed": FigureSpec("jobs completed after the window", "jobs"),
}


def run(ctx: BenchContext, result: BenchResult) -> None:
    if ctx.quick:
        workers, concurrency, chunks, stream_s, settle_s, window_s, heartbeat_s = 2, 25, 15, 15.0, 3.0, 6.0, 2.0
    else:
        workers, concurrency, chunks, stream_s, settle_s, window_s, heartbeat_s = 10, 100, 60, 60.0, 11.0, 30.0, 10.0
    jobs = workers * concurrency
    result.params.update({
        "worker_processes": workers, "worker_concurrency": concurrency, "jobs": jobs,
        "stream_chunks": chunks, "stream_s": stream_s, "settle_s": settle_s, "window_s": window_s,
        "heartbeat_interval_s": heartbeat_s,
    })
    for run_number in range(1, ctx.runs + 1):
        _in_flight_once(ctx, result, workers=workers, concurrency=concurrency, chunks=chunks, stream_s=stream_s,
                        settle_s=settle_s, window_s=window_s, heartbeat_s=heartbeat_s)
        ctx.progress(f"in flight run {run_number}/{ctx.runs}: " + ", ".join(
            f"{key} {values[-1]:,.2f}" for key, values in result.samples.items()))


def _in_flight_once(ctx: BenchContext, result: BenchResult, *, workers: int, concurrency: int, chunks: int,
                    stream_s: float, settle_s: float, window_s: float, heartbeat_s: float) -> None:
    jobs = workers * concurrency
    with ctx.database("in_flight") as bench_db, ctx.processes(bench_db) as system:
        provider = Proc("fake-provider", "tests.bench.fake_provider",
                        {**system.env, "FAKE_PROVIDER_CHUNKS": str(chunks), "FAKE_PROVIDER_STREAM_S": str(stream_s)},
                        system.log_dir / "fake-provider.log")
        system.procs.append(provider)  # stopped with the workers
        listening = provider.wait_for_event("fake_provider.listening")
        llm = {"ANTHROPIC_API_KEY": "test", "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{listening['port']}"}
        procs = [
            system.worker(wait=False, WORKER_CONCURRENCY=concurrency, HEARTBEAT_INTERVAL_S=heartbeat_s,
                          WORKER_SHUTDOWN_GRACE_S=5, **llm)
            for _ in range(workers)
        ]
        watched = [*procs, provider]
        bench_db.wait_workers_listening(watched, workers, timeout_s=120)
        time.sleep(1.0)
        idle_rss = sum(rss_bytes(proc.pid) for proc in procs)

        client_id = bench_db.create_client()
        bench_db.insert_pending(client_id, jobs, notify=True)
        bench_db.wait_until(f"{jobs} jobs running", lambda: bench_db.count_status("running") == jobs, watched,
                            timeout_s=120)
        # backends publish their counters up to 10 s after going idle: let the
        # claims land before the window opens
        time.sleep(settle_s)

        with DatabaseCounters(bench_db.server_url, bench_db.name) as counters, \
                StatementCounter(bench_db, counters) as statements:
            result.note(statements.description)
            pids = counters.backend_pids(excluding=bench_db.reader_pid())
            cpu_before = {pid: cpu_seconds(pid) for pid in pids}
            provider_before = cpu_seconds(provider.pid)
            statements_before = statements.count()
            opened = time.monotonic()
            time.sleep(window_s)
            statements_after = statements.count()
            elapsed = time.monotonic() - opened
            provider_after = cpu_seconds(provider.pid)
            cpu_after = {pid: cpu_seconds(pid) for pid in counters.backend_pids(excluding=bench_db.reader_pid())}
            busy_rss = sum(rss_bytes(proc.pid) for proc in procs)
        running_after = bench_db.count_status("running")

        result.add("jobs_running", running_after)
        result.add("statements_per_s", (statements_after - statements_before) / elapsed)
        result.add("worker_rss_per_job_kib", (busy_rss - idle_rss) / jobs / 1024)
        if provider_before is not None and provider_after is not None:
            result.add("provider_cpu_pct_of_core", (provider_after - provider_before) / elapsed * 100)
        if all(is_postgres_process(pid) for pid in cpu_after):
            gone = [pid for pid in pids if pid not in cpu_after]
            if gone:
                result.note(f"{len(gone)} backend(s) ended during a window; their CPU in it is not counted")
            used = sum((after or 0.0) - (cpu_before.get(pid) or 0.0) for pid, after in cpu_after.items())
            result.add("db_cpu_pct_of_core", used / elapsed * 100)
        else:
            result.note("database CPU not measured: the Postgres backends are not local processes "
                        "(e.g. a container)")
        if running_after < jobs:
            result.note(f"only {running_after} of {jobs} jobs were still running at the end of a window")

        bench_db.wait_drained(watched, timeout_s=stream_s * 2 + 60)
        result.add("jobs_completed", bench_db.count_status("completed"))
        provider.stop()
        stopped = [event for event in provider.events() if event.get("event") == "fake_provider.stopped"]
        if stopped and stopped[-1]["closed_early"]:
            result.note(f"{stopped[-1]['closed_early']} streams were closed early by the client in a run")
    if chunks != 60 or stream_s != 60.0:
        result.note(f"streams of {chunks} chunks over {stream_s:g} s (quick mode)")
