"""idle: what idle workers cost the database.

4 workers with nothing to do (default WORKER_POLL_INTERVAL_S and heartbeat
interval) for a window; the statements they send per second, per worker.
pg_stat_statements is used when the server preloads it; otherwise every
statement of an autocommit connection is one transaction, so the count is
pg_stat_database.xact_commit + xact_rollback of the benchmark database, read
over a connection to the maintenance database so that reading adds nothing
to what is measured.
"""

from __future__ import annotations

import time

from tests.bench.harness import (
    BenchContext,
    BenchResult,
    DatabaseCounters,
    FigureSpec,
    StatementCounter,
)

NAME = "idle"
SPECS = {
    "statements_per_s_per_worker": FigureSpec("statements/s per idle worker", "stmt/s"),
}
WORKERS = 4
WORKER_ENV = {"OFFLINE_DELAY_S": 0}


def run(ctx: BenchContext, result: BenchResult) -> None:
    window_s = 6.0 if ctx.quick else 30.0
    # backends publish their counters up to 10 s after going idle: let the
    # start-up statements land before the window opens
    settle_s = 3.0 if ctx.quick else 12.0
    result.params.update({"workers": WORKERS, "window_s": window_s, "settle_s": settle_s,
                                              "worker_env": WORKER_ENV})
    for run_number in range(1, ctx.runs + 1):
        per_worker = _idle_once(ctx, result, window_s=window_s, settle_s=settle_s)
        result.add("statements_per_s_per_worker", per_worker)
        ctx.progress(f"idle run {run_number}/{ctx.runs}: {per_worker:.3f} statements/s per worker")


def _idle_once(ctx: BenchContext, result: BenchResult, *, window_s: float, settle_s: float) -> float:
    with ctx.database("idle") as bench_db, ctx.processes(bench_db, **WORKER_ENV) as system:
        workers = [system.worker(wait=False) for _ in range(WORKERS)]
        bench_db.wait_workers_listening(workers, WORKERS)
        with DatabaseCounters(bench_db.server_url, bench_db.name) as counters, \
                StatementCounter(bench_db, counters) as statements:
            result.note(statements.description)
            time.sleep(settle_s)
            before = statements.count()
            opened = time.monotonic()
            time.sleep(window_s)
            after = statements.count()
            elapsed = time.monotonic() - opened
        for worker in workers:
            if worker.popen.poll() is not None:
                raise RuntimeError(f"a worker exited during the window:\n{worker.output()[-2000:]}")
    return (after - before) / elapsed / WORKERS
