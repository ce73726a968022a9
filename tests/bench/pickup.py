"""pickup: how soon an idle worker starts a job the api just stored.

4 idle workers (offline writer, no delay, default WORKER_POLL_INTERVAL_S, so
the wake-up is the api's NOTIFY) and one api; jobs are enqueued over HTTP
one at a time at a steady ~20/s. Pickup = started_at - created_at of each
job, both by the database's clock.
"""

from __future__ import annotations

import time
import uuid

import httpx

from tests.bench.harness import BenchContext, BenchResult, FigureSpec, percentile
from tests.support.database import create_key_sync

NAME = "pickup"
SPECS = {
    "p50_ms": FigureSpec("started_at - created_at, p50", "ms"),
    "p99_ms": FigureSpec("started_at - created_at, p99", "ms"),
}
WORKERS = 4
RATE_PER_S = 20.0
WARMUP_JOBS = 5
WORKER_ENV = {"OFFLINE_DELAY_S": 0}
API_ENV = {"QUEUE_MAX": 1_000_000, "CLIENT_QUEUE_MAX": 1_000_000}

_PICKUP_MS = """
SELECT extract(epoch FROM started_at - created_at)::float8 * 1000
FROM story_jobs
WHERE idempotency_key LIKE 'measured-%'
"""


def run(ctx: BenchContext, result: BenchResult) -> None:
    duration_s = 2.0 if ctx.quick else 10.0
    result.params.update({
        "workers": WORKERS, "rate_per_s": RATE_PER_S, "duration_s": duration_s, "worker_env": WORKER_ENV,
        "wake_up": "NOTIFY from the api's insert (WORKER_POLL_INTERVAL_S left at its default)",
    })
    for run_number in range(1, ctx.runs + 1):
        pickups = _pickup_once(ctx, duration_s)
        result.add("p50_ms", percentile(pickups, 50))
        result.add("p99_ms", percentile(pickups, 99))
        result.params["jobs_per_run"] = len(pickups)
        ctx.progress(f"pickup run {run_number}/{ctx.runs}: p50 {percentile(pickups, 50):.2f} ms, "
                     f"p99 {percentile(pickups, 99):.2f} ms over {len(pickups)} jobs")


def _pickup_once(ctx: BenchContext, duration_s: float) -> list[float]:
    with ctx.database("pickup") as bench_db:
        key = create_key_sync(bench_db.url, "bench")
        with ctx.processes(bench_db, **WORKER_ENV, **API_ENV) as system:
            workers = [system.worker(wait=False) for _ in range(WORKERS)]
            api = system.api()
            bench_db.wait_workers_listening(workers, WORKERS)
            with httpx.Client(base_url=api.base_url, timeout=10,
                              headers={"Authorization": f"Bearer {key}"}) as client:
                for _ in range(WARMUP_JOBS):
                    _enqueue(client, f"warmup-{uuid.uuid4()}")
                bench_db.wait_drained(workers, timeout_s=30)
                count = round(duration_s * RATE_PER_S)
                started = time.monotonic()
                for n in range(count):
                    delay = started + n / RATE_PER_S - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    _enqueue(client, f"measured-{uuid.uuid4()}")
            bench_db.wait_drained(workers, timeout_s=30)
        with bench_db.connect() as conn:
            return [row[0] for row in conn.execute(_PICKUP_MS).fetchall()]


def _enqueue(client: httpx.Client, idempotency_key: str) -> None:
    answer = client.post("/stories/generate", json={"prompt": "bench", "length": "short"},
                         headers={"Idempotency-Key": idempotency_key})
    if answer.status_code != 202:
        raise RuntimeError(f"POST /stories/generate answered {answer.status_code}: {answer.text[:300]}")
