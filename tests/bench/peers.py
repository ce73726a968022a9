"""peers: storyjobs beside pgqueuer, procrastinate and the bare
claim-then-complete loop, on the same Postgres, in the same run.

This machine is shared and its speed changes from minute to minute, so a
figure means something only beside its peers measured under the same load.
Every round runs each scenario for every system back to back, in the order
storyjobs, pgqueuer, procrastinate, bare loop (see peer_queues.py for how
each is installed, fed, run and timed); each figure is then also given as
a ratio storyjobs / peer *within the round*, and the report shows the median
of those per-round ratios with their min and max.

Scenarios, each on a fresh database with the system's own schema:

* drain: the jobs are enqueued in bulk by the system's own client, then 4
  worker processes start and empty the queue with a no-op task, one job at a
  time and batched. jobs/s = jobs / (last finished - first picked), by the
  database's clock. Per job: the CPU of the database's backends (read from
  /proc when the server is local), the CPU of the worker processes less what
  one spends starting up (measured once per system on an idle worker), and
  the transactions and rows written (pg_stat_database, read after every
  connection closed, less the harness's own reads).
* pickup: 4 idle workers, jobs enqueued one at a time at a steady 20/s by
  the system's own client (storyjobs: POST to its api); pickup = picked at -
  enqueued at, p50 and p99.
* idle: 4 idle workers of every system at once, each system in its own
  database, for one window: statements per second per worker (idle counts
  do not depend on the machine's speed, so the systems share the window).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.bench.harness import (
    BenchContext,
    BenchDatabase,
    BenchResult,
    DatabaseCounters,
    FigureSpec,
    StatementCounter,
    cpu_seconds,
    percentile,
)
from tests.bench.peer_queues import QUEUES, Enqueuer, Queue
from tests.support.waiting import wait_until_sync
from tests.system.procs import Proc

NAME = "peers"
BATCH = 10
PICKUP_RATE_PER_S = 20.0
PICKUP_WARMUP_JOBS = 5
SUBJECT = "storyjobs"
PEERS = [queue.name for queue in QUEUES if queue.name != SUBJECT]
TITLES = {queue.name: queue.title for queue in QUEUES}


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    higher_is_better: bool


METRICS = [
    Metric("drain_one_jobs_per_s", "drain, one job at a time", "jobs/s", True),
    Metric("drain_batched_jobs_per_s", f"drain, batched ({BATCH})", "jobs/s", True),
    Metric("drain_one_db_cpu_ms_per_job", "Postgres CPU per job, one at a time", "ms", False),
    Metric("drain_batched_db_cpu_ms_per_job", "Postgres CPU per job, batched", "ms", False),
    Metric("drain_one_worker_cpu_ms_per_job", "worker CPU per job, one at a time", "ms", False),
    Metric("drain_batched_worker_cpu_ms_per_job", "worker CPU per job, batched", "ms", False),
    Metric("drain_one_xacts_per_job", "transactions per job, one at a time", "xacts", False),
    Metric("drain_batched_xacts_per_job", "transactions per job, batched", "xacts", False),
    Metric("drain_one_rows_per_job", "rows written per job, one at a time", "rows", False),
    Metric("drain_batched_rows_per_job", "rows written per job, batched", "rows", False),
    Metric("pickup_p50_ms", "pickup p50", "ms", False),
    Metric("pickup_p99_ms", "pickup p99", "ms", False),
    Metric("idle_stmt_per_s_per_worker", "statements/s per idle worker", "stmt/s", False),
]

# the targets of issue 15, judged on the median of the per-round ratios
TARGETED = {
    "vs_pgqueuer.drain_one_jobs_per_s",
    "vs_bare.drain_one_jobs_per_s",
    "vs_pgqueuer.drain_batched_jobs_per_s",
    "vs_bare.pickup_p99_ms",
    f"{SUBJECT}.drain_one_db_cpu_ms_per_job",
}


def figure_key(system: str, metric: str) -> str:
    return f"{system}.{metric}"


def ratio_key(peer: str, metric: str) -> str:
    return f"vs_{peer}.{metric}"


SPECS: dict[str, FigureSpec] = {}
for _metric in METRICS:
    for _queue in QUEUES:
        _key = figure_key(_queue.name, _metric.key)
        SPECS[_key] = FigureSpec(f"{_queue.title}: {_metric.label}", _metric.unit, in_table=_key in TARGETED)
for _metric in METRICS:
    for _peer in PEERS:
        _key = ratio_key(_peer, _metric.key)
        SPECS[_key] = FigureSpec(
            f"storyjobs / {TITLES[_peer]}: {_metric.label} ({'higher' if _metric.higher_is_better else 'lower'} "
            "is better for storyjobs)", "×", in_table=_key in TARGETED)


@dataclass(frozen=True)
class Sizes:
    workers: int
    jobs: int
    pickup_s: float
    idle_settle_s: float
    idle_window_s: float
    # 0: worker CPU per job is not reported (it would be mostly start-up)
    startup_samples: int


# pickup: 400 jobs a round, so that its p99 is not one stray job
FULL = Sizes(workers=4, jobs=5_000, pickup_s=20.0, idle_settle_s=12.0, idle_window_s=30.0, startup_samples=2)
# a smoke run of every path in seconds: its figures mean little (the idle
# window is shorter than the delay before backends publish their counts)
QUICK = Sizes(workers=2, jobs=200, pickup_s=0.5, idle_settle_s=0.5, idle_window_s=2.0, startup_samples=0)


def run(ctx: BenchContext, result: BenchResult) -> None:
    sizes = QUICK if ctx.quick else FULL
    queues = []
    for queue in QUEUES:
        reason = queue.missing()
        if reason is None:
            queues.append(queue)
        else:
            result.note(f"{queue.title} skipped: {reason}")
    for queue in queues:
        queue.prepare(ctx)
    result.params.update({
        "systems": [queue.title for queue in queues],
        "workers": sizes.workers,
        "jobs": sizes.jobs,
        "one_at_a_time": {queue.name: queue.mode_one for queue in queues},
        "batched": {queue.name: queue.mode_batched for queue in queues},
        "pickup": f"{PICKUP_RATE_PER_S:g} jobs/s for {sizes.pickup_s:g} s after {PICKUP_WARMUP_JOBS} warm-up jobs",
        "idle_window_s": sizes.idle_window_s,
        "versions": _versions(),
    })
    failures: list[str] = []
    startup_cpu_s = _startup_cpu_s(ctx, queues, sizes.startup_samples)
    if startup_cpu_s:
        result.params["worker_startup_cpu_s"] = {name: round(value, 3) for name, value in startup_cpu_s.items()}
        result.note(f"worker CPU per job: the workers' CPU less {sizes.workers} × one worker's start-up, measured "
                    "apart; below about 0.02 ms per job that subtraction's error dominates")
    else:
        result.note("worker CPU per job not measured in quick mode")
    for round_number in range(1, ctx.runs + 1):
        measured: dict[str, dict[str, float]] = {queue.name: {} for queue in queues}
        where = f"peers round {round_number}/{ctx.runs}"
        for batched in (False, True):
            mode = "batched" if batched else "one"
            for queue in queues:
                figures = _attempt(ctx, failures, f"{where}: drain {mode}: {queue.title}", lambda: _drain_once(
                    ctx, queue, sizes, batched=batched, mode=mode,  # noqa: B023 - called at once
                    startup_cpu_s=startup_cpu_s.get(queue.name)))  # noqa: B023
                measured[queue.name].update(figures)
                if figures:
                    ctx.progress(f"{where}: drain {mode}: {queue.title}: "
                                 f"{figures[f'drain_{mode}_jobs_per_s']:,.0f} jobs/s, Postgres CPU "
                                 f"{figures.get(f'drain_{mode}_db_cpu_ms_per_job', float('nan')):.3f} ms/job")
        for queue in queues:
            figures = _attempt(ctx, failures, f"{where}: pickup: {queue.title}",
                               lambda: _pickup_once(ctx, queue, sizes))  # noqa: B023 - called at once
            measured[queue.name].update(figures)
            if figures:
                ctx.progress(f"{where}: pickup: {queue.title}: p50 {figures['pickup_p50_ms']:.2f} ms, "
                             f"p99 {figures['pickup_p99_ms']:.2f} ms")
        idle = _attempt(ctx, failures, f"{where}: idle", lambda: _idle_once(ctx, queues, sizes))
        for name, per_worker in idle.items():
            measured[name]["idle_stmt_per_s_per_worker"] = per_worker
        if idle:
            ctx.progress(f"{where}: idle: " + ", ".join(
                f"{TITLES[name]} {per_worker:.3f}" for name, per_worker in idle.items()) + " statements/s per worker")
        _record_round(result, measured)
    result.note("ratios are storyjobs / peer, computed within each round, then the median (min-max) over rounds")
    result.note("storyjobs is fed through its api (POST /stories/generate): its pickup starts at created_at, the "
                "start of the admission transaction (the admission lock, then the insert); the peers' clients and "
                "the bare loop's enqueue are one statement each")
    if failures:
        result.error = "; ".join(failures)[:2000]


def _attempt(ctx: BenchContext, failures: list[str], what: str, measure: Callable[[], dict[str, float]]
             ) -> dict[str, float]:
    """One system's figures of one scenario, or none when it failed: the
    failure is reported, and the round's other figures still count."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - one system's failure must not lose the others' figures
        failures.append(f"{what}: {type(exc).__name__}: {exc}"[:1500])
        ctx.progress(f"failed: {failures[-1]}")
        return {}


def _record_round(result: BenchResult, measured: dict[str, dict[str, float]]) -> None:
    for name, values in measured.items():
        for key, value in values.items():
            result.add(figure_key(name, key), value)
    subject = measured.get(SUBJECT, {})
    for peer in PEERS:
        for key, value in measured.get(peer, {}).items():
            if key in subject and value > 0:
                result.add(ratio_key(peer, key), subject[key] / value)


def _versions() -> dict[str, str]:
    from importlib import metadata

    versions = {}
    for distribution in ("storyjobs", "pgqueuer", "asyncpg", "procrastinate", "psycopg"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[distribution] = metadata.version(distribution)
    return versions


# -- each scenario ---------------------------------------------------------------------------------


def _wait_ready(queue: Queue, bench_db: BenchDatabase, workers: list[Proc]) -> None:
    expected = len(workers) * queue.ready_per_worker
    bench_db.wait_until(f"{len(workers)} {queue.title} workers to connect",
                        lambda: queue.ready_connections(bench_db) >= expected, workers, timeout_s=60)


def _wait_backends_gone(counters: DatabaseCounters, *, timeout_s: float = 15.0) -> None:
    """Until no client is connected: every backend has published its counters."""
    wait_until_sync(lambda: not counters.backend_pids(), timeout=timeout_s, interval=0.05,
                    what="the connections to the benchmark database to close")


def _startup_cpu_s(ctx: BenchContext, queues: list[Queue], samples: int) -> dict[str, float]:
    """CPU one worker of each system spends from exec to waiting for work,
    the systems side by side (CPU time is the same however they share the
    cores): subtracted from the workers' CPU in the drains."""
    found: dict[str, list[float]] = {queue.name: [] for queue in queues}
    for _ in range(samples):
        with contextlib.ExitStack() as stack:
            started = []
            for queue in queues:
                bench_db = stack.enter_context(queue.database(ctx, "peers_startup"))
                system = stack.enter_context(ctx.processes(bench_db))
                started.append((queue, bench_db, queue.start_workers(system, 1, batched=False, draining=True)))
            for queue, bench_db, workers in started:
                _wait_ready(queue, bench_db, workers)
            settled = _settled_cpu([workers[0] for _, _, workers in started])
            for (queue, _, _), cpu in zip(started, settled, strict=True):
                found[queue.name].append(cpu)
    return {name: statistics.median(values) for name, values in found.items() if values}


def _settled_cpu(procs: list[Proc], *, quiet_s: float = 1.0, timeout_s: float = 15.0) -> list[float]:
    """Each process's CPU once none of them has used any for quiet_s."""
    deadline = time.monotonic() + timeout_s
    last = [cpu_seconds(proc.pid) or 0.0 for proc in procs]
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.1)
        now = [cpu_seconds(proc.pid) or 0.0 for proc in procs]
        if now != last:
            last, quiet_since = now, time.monotonic()
    return last


class _CountingReader:
    """The harness's reads of the benchmark database, counted, so that its
    own transactions can be taken out of the database's count."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self, read: Any) -> Any:
        self.reads += 1
        return read()


def _drain_once(ctx: BenchContext, queue: Queue, sizes: Sizes, *, batched: bool, mode: str,
                startup_cpu_s: float | None) -> dict[str, float]:
    jobs = sizes.jobs
    reader = _CountingReader()
    with queue.database(ctx, "peers_drain") as bench_db, \
            DatabaseCounters(bench_db.server_url, bench_db.name) as counters:
        queue.enqueue_bulk(bench_db, jobs)
        bench_db.close()
        _wait_backends_gone(counters)
        xacts_before, rows_before = counters.activity()
        with ctx.processes(bench_db) as system:
            workers = queue.start_workers(system, sizes.workers, batched=batched, draining=True)
            bench_db.wait_until("the queue to drain", lambda: reader(lambda: queue.unfinished(bench_db)) == 0,
                                workers, timeout_s=60 + jobs / 20, interval_s=0.1)
            worker_cpu_s = sum(cpu_seconds(worker.pid) or 0.0 for worker in workers)
            backend_cpu = [cpu_seconds(pid) for pid in counters.backend_pids(excluding=bench_db.reader_pid())]
            timing = reader(lambda: queue.drain_timing(bench_db))
        bench_db.close()
        _wait_backends_gone(counters)
        xacts_after, rows_after = counters.activity()
    if timing.completed != jobs:
        raise RuntimeError(f"{timing.completed} of {jobs} jobs finished")
    figures = {
        f"drain_{mode}_jobs_per_s": timing.completed / timing.span_s,
        f"drain_{mode}_xacts_per_job": (xacts_after - xacts_before - reader.reads) / jobs,
        f"drain_{mode}_rows_per_job": (rows_after - rows_before) / jobs,
    }
    if startup_cpu_s is not None:
        figures[f"drain_{mode}_worker_cpu_ms_per_job"] = (
            max(worker_cpu_s - sizes.workers * startup_cpu_s, 0.0) / jobs * 1000)
    if backend_cpu and all(cpu is not None for cpu in backend_cpu):
        figures[f"drain_{mode}_db_cpu_ms_per_job"] = sum(cpu or 0.0 for cpu in backend_cpu) / jobs * 1000
    return figures


def _pickup_once(ctx: BenchContext, queue: Queue, sizes: Sizes) -> dict[str, float]:
    with queue.database(ctx, "peers_pickup") as bench_db, ctx.processes(bench_db) as system:
        workers = queue.start_workers(system, sizes.workers, batched=False, draining=False)
        _wait_ready(queue, bench_db, workers)
        enqueuer = queue.enqueuer(system, bench_db)
        keys = asyncio.run(_paced(queue, bench_db, workers, enqueuer, round(sizes.pickup_s * PICKUP_RATE_PER_S)))
        bench_db.wait_until("the queue to drain", lambda: queue.unfinished(bench_db) == 0, workers, timeout_s=30)
        pickups = queue.pickup_ms(bench_db, keys)
    if len(pickups) != len(keys):
        raise RuntimeError(f"found the pickup of {len(pickups)} of {len(keys)} jobs")
    return {"pickup_p50_ms": percentile(pickups, 50), "pickup_p99_ms": percentile(pickups, 99)}


async def _paced(queue: Queue, bench_db: BenchDatabase, workers: list[Proc], enqueuer: Enqueuer,
                 count: int) -> list[Any]:
    """Warm-up jobs, then count jobs at a steady rate; their keys."""
    async with enqueuer:
        for _ in range(PICKUP_WARMUP_JOBS):
            await enqueuer.enqueue()
        await asyncio.to_thread(bench_db.wait_until, "the warm-up jobs", lambda: queue.unfinished(bench_db) == 0,
                                workers, timeout_s=30, interval_s=0.05)
        keys = []
        started = time.monotonic()
        for n in range(count):
            delay = started + n / PICKUP_RATE_PER_S - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            keys.append(await enqueuer.enqueue())
        return keys


def _idle_once(ctx: BenchContext, queues: list[Queue], sizes: Sizes) -> dict[str, float]:
    with contextlib.ExitStack() as stack:
        started = []
        for queue in queues:
            bench_db = stack.enter_context(queue.database(ctx, "peers_idle"))
            system = stack.enter_context(ctx.processes(bench_db))
            started.append((queue, bench_db, queue.start_workers(system, sizes.workers, batched=False,
                                                                 draining=False)))
        statements = []
        for queue, bench_db, workers in started:
            _wait_ready(queue, bench_db, workers)
            counters = stack.enter_context(DatabaseCounters(bench_db.server_url, bench_db.name))
            statements.append(stack.enter_context(StatementCounter(bench_db, counters)))
        # backends publish their counters up to 10 s after going idle
        time.sleep(sizes.idle_settle_s)
        before = [counter.count() for counter in statements]
        opened = time.monotonic()
        time.sleep(sizes.idle_window_s)
        after = [counter.count() for counter in statements]
        elapsed = time.monotonic() - opened
        for queue, _, workers in started:
            for worker in workers:
                if worker.popen.poll() is not None:
                    raise RuntimeError(f"a {queue.title} worker exited while idle:\n{worker.output()[-2000:]}")
    return {queue.name: (end - start) / elapsed / sizes.workers
            for (queue, _, _), start, end in zip(started, before, after, strict=True)}


# -- the report's section ------------------------------------------------------------------------------


def markdown_section(bench: dict[str, Any]) -> list[str]:
    """Two tables: the ratios storyjobs / peer, and the figures they come from."""
    from tests.bench.report import TARGETS, _number

    figures = bench["figures"]

    def cell(key: str, unit: str = "") -> str:
        figure = figures.get(key)
        if figure is None:
            return "—"
        spread = "" if len(figure["samples"]) < 2 else (
            f" ({_number(figure['min'])}-{_number(figure['max'])})")
        return f"{_number(figure['median'])}{unit}{spread}"

    peers = [name for name in PEERS if any(key.startswith(f"vs_{name}.") for key in figures)]
    systems = [name for name in TITLES if any(key.startswith(f"{name}.") for key in figures)]
    lines = [
        "", "## storyjobs beside its peers", "",
        "Ratios storyjobs / peer, each computed within one round (every round runs every system back to back), "
        "then the median over the rounds, with min-max. ↑: higher is better for storyjobs; ↓: lower is.", "",
        "| figure | " + " | ".join(f"vs {TITLES[name]}" for name in peers) + " | target |",
        "|---|" + "---:|" * len(peers) + "---|",
    ]
    for metric in METRICS:
        targets = []
        for name in peers:
            target = TARGETS.get((NAME, ratio_key(name, metric.key)))
            if target is not None:
                met = figures.get(ratio_key(name, metric.key))
                verdict = "" if met is None else (" met" if target.check(met["median"]) else " **not met**")
                targets.append(f"vs {TITLES[name]} {target.text}×{verdict}")
        arrow = "↑" if metric.higher_is_better else "↓"
        lines.append(f"| {metric.label} {arrow} | "
                     + " | ".join(cell(ratio_key(name, metric.key), "×") for name in peers)
                     + f" | {'; '.join(targets) or '—'} |")
    lines += [
        "", "The figures (median of the rounds, min-max):", "",
        "| figure | unit | " + " | ".join(TITLES[name] for name in systems) + " | target |",
        "|---|---|" + "---:|" * len(systems) + "---|",
    ]
    for metric in METRICS:
        target = TARGETS.get((NAME, figure_key(SUBJECT, metric.key)))
        subject = figures.get(figure_key(SUBJECT, metric.key))
        verdict = ""
        if target is not None and subject is not None:
            verdict = f"storyjobs {target.text} {metric.unit}" + (
                " met" if target.check(subject["median"]) else " **not met**")
        lines.append(f"| {metric.label} | {metric.unit} | "
                     + " | ".join(cell(figure_key(name, metric.key)) for name in systems)
                     + f" | {verdict or '—'} |")
    return lines
