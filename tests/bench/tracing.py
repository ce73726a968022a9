"""tracing: what OpenTelemetry costs a story, with it on and off.

Two measurements, each taken in turns with tracing off and on (exporting
over OTLP/HTTP to a receiver on loopback, tests/fakes/otlp_receiver.py, as
to a collector) so that both meet the same load of a shared machine:

* the worker: a backlog of instant jobs (offline writer, no delay) drained
  by one process at concurrency 10; its CPU per job, less what it spends
  starting, and the jobs per second (as the drain measures them);
* the api: POSTs to /stories/generate, one after the other on one
  connection; the api process's CPU per POST.

The difference is tracing's cost per job: the run's span (and the SDK's, not
made by the offline writer) on the worker, the server span and the admission
span on the api. With tracing off, nothing of the SDK is loaded: the
``off`` rows are the drain's and the api's own.
"""

from __future__ import annotations

import statistics
import time
import uuid

import httpx

from tests.bench.harness import BenchContext, BenchResult, FigureSpec, cpu_seconds
from tests.fakes.otlp_receiver import OtlpReceiverServer
from tests.support.database import create_key_sync

NAME = "tracing"
SPECS: dict[str, FigureSpec] = {
    "worker_cpu_us_per_job_off": FigureSpec("worker CPU per job, tracing off", "µs"),
    "worker_cpu_us_per_job_on": FigureSpec("worker CPU per job, tracing on", "µs"),
    "worker_cost_us_per_job": FigureSpec("worker: tracing's cost per job (on − off)", "µs"),
    "drain_jobs_per_s_off": FigureSpec("drain, 1 proc × conc 10, tracing off", "jobs/s"),
    "drain_jobs_per_s_on": FigureSpec("drain, 1 proc × conc 10, tracing on", "jobs/s"),
    "api_cpu_us_per_post_off": FigureSpec("api CPU per POST, tracing off", "µs"),
    "api_cpu_us_per_post_on": FigureSpec("api CPU per POST, tracing on", "µs"),
    "api_cost_us_per_post": FigureSpec("api: tracing's cost per POST (on − off)", "µs"),
}
WORKER_ENV = {"OFFLINE_DELAY_S": 0, "WORKER_POLL_INTERVAL_S": 0.2, "WORKER_CONCURRENCY": 10}
API_ENV = {"QUEUE_MAX": 10_000_000, "CLIENT_QUEUE_MAX": 10_000_000}

_SPAN = "SELECT extract(epoch FROM max(completed_at) - min(started_at))::float8 FROM story_jobs"


def run(ctx: BenchContext, result: BenchResult) -> None:
    jobs = 300 if ctx.quick else 2000
    posts = 200 if ctx.quick else 1000
    result.params.update({"jobs": jobs, "posts": posts, "worker_env": WORKER_ENV})
    with OtlpReceiverServer() as receiver:
        tracing = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_SEMCONV_STABILITY_OPT_IN": "http"}
        startup = {mode: _worker_startup_cpu_s(ctx, env) for mode, env in (("off", {}), ("on", tracing))}
        for run_number in range(1, ctx.runs + 1):
            for mode, env in (("off", {}), ("on", tracing))[:: 1 if run_number % 2 else -1]:
                cpu_s, rate = _drain(ctx, jobs, env)
                result.add(f"worker_cpu_us_per_job_{mode}", max(cpu_s - startup[mode], 0.0) / jobs * 1e6)
                result.add(f"drain_jobs_per_s_{mode}", rate)
                result.add(f"api_cpu_us_per_post_{mode}", _posts(ctx, posts, env) / posts * 1e6)
                ctx.progress(f"tracing run {run_number}/{ctx.runs}: {mode}: {rate:,.0f} jobs/s")
            for who, unit in (("worker", "job"), ("api", "post")):
                key = f"{who}_cpu_us_per_{unit}"
                on, off = result.samples[f"{key}_on"][-1], result.samples[f"{key}_off"][-1]
                result.add(f"{who}_cost_us_per_{unit}", on - off)
        if not receiver.receiver.received():
            result.note("no span reached the receiver with tracing on: the on rows measured nothing")


def _worker_startup_cpu_s(ctx: BenchContext, env: dict[str, str]) -> float:
    samples = []
    for _ in range(2):
        with ctx.database("tracing_startup") as bench_db, ctx.processes(bench_db, **WORKER_ENV, **env) as system:
            worker = system.worker(wait=False)
            bench_db.wait_workers_listening([worker], 1)
            time.sleep(0.5)
            samples.append(cpu_seconds(worker.pid) or 0.0)
    return statistics.median(samples)


def _drain(ctx: BenchContext, jobs: int, env: dict[str, str]) -> tuple[float, float]:
    """The worker's CPU draining ``jobs``, and the jobs per second."""
    with ctx.database("tracing_drain") as bench_db:
        bench_db.insert_pending(bench_db.create_client(), jobs)
        with ctx.processes(bench_db, **WORKER_ENV, **env) as system:
            worker = system.worker(wait=False)
            bench_db.wait_drained([worker], timeout_s=60 + jobs / 20)
            cpu_s = cpu_seconds(worker.pid) or 0.0
        span_s = float(bench_db.scalar(_SPAN))
    return cpu_s, jobs / span_s


def _posts(ctx: BenchContext, posts: int, env: dict[str, str]) -> float:
    """The api process's CPU for ``posts`` POSTs, less its CPU before them (start-up, warm-up)."""
    with ctx.database("tracing_api") as bench_db, ctx.processes(bench_db, **API_ENV, **env) as system:
        api = system.api()
        key = create_key_sync(bench_db.url, "bench")
        with httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as client:
            for _ in range(20):
                client.post("/stories/generate", json={"prompt": "a warm-up"},
                            headers={"Idempotency-Key": str(uuid.uuid4())})
            before = cpu_seconds(api.pid) or 0.0
            for _ in range(posts):
                answer = client.post("/stories/generate", json={"prompt": "a fox who counts"},
                                     headers={"Idempotency-Key": str(uuid.uuid4())})
                if answer.status_code != 202:
                    raise RuntimeError(f"POST answered {answer.status_code}: {answer.text[:200]}")
            return (cpu_seconds(api.pid) or 0.0) - before
