"""stop: how soon a cancelled job's stream is closed.

One worker streams 10 jobs, one after another, from the fake provider (in
this process, on loopback; streams far longer than the run) with
HEARTBEAT_INTERVAL_S = 1. Each job is cancelled, at a random moment of the
worker's heartbeat cycle, as a client's DELETE does (one statement); the
figure is how long after the cancellation the provider saw the stream
closed: the worker learns of it at its next heartbeat, so it lies between 0
and one interval, plus the heartbeat's own round trip. The tests assert only that a
stream is closed long before its end; the latency is measured here.
"""

from __future__ import annotations

import random
import time

import psycopg

from tests.bench.harness import BenchContext, BenchResult, FigureSpec, percentile
from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer, Plan

NAME = "stop"
SPECS = {
    "close_after_cancel_p50_s": FigureSpec("stream closed after a cancel, p50", "s"),
    "close_after_cancel_max_s": FigureSpec("stream closed after a cancel, max", "s"),
    "close_after_cancel_over_interval": FigureSpec("max / HEARTBEAT_INTERVAL_S", "x"),
}
JOBS = 10
HEARTBEAT_S = 1.0


def run(ctx: BenchContext, result: BenchResult) -> None:
    result.params.update({"jobs": JOBS, "heartbeat_interval_s": HEARTBEAT_S})
    for run_number in range(1, ctx.runs + 1):
        latencies = _stop_once(ctx)
        result.add("close_after_cancel_p50_s", percentile(latencies, 50))
        result.add("close_after_cancel_max_s", max(latencies))
        result.add("close_after_cancel_over_interval", max(latencies) / HEARTBEAT_S)
        ctx.progress(f"stop run {run_number}/{ctx.runs}: max {max(latencies):.3f} s")


def _stop_once(ctx: BenchContext) -> list[float]:
    """Jobs one after another, each cancelled at a random moment of the worker's heartbeat cycle."""
    fake = FakeAnthropic(default=Plan(chunks=600, duration_s=600))
    rng = random.Random(len(fake.calls))
    latencies = []
    with FakeAnthropicServer(fake) as server, ctx.database("stop") as bench_db, \
            ctx.processes(bench_db) as system, psycopg.connect(bench_db.url, autocommit=True) as conn:
        worker = system.worker(wait=False, HEARTBEAT_INTERVAL_S=HEARTBEAT_S, HEARTBEAT_TIMEOUT_S=HEARTBEAT_S * 3,
                               WORKER_SHUTDOWN_GRACE_S=5, ANTHROPIC_API_KEY="test",
                               ANTHROPIC_BASE_URL=server.base_url)
        bench_db.wait_workers_listening([worker], 1)
        client_id = bench_db.create_client()
        for n in range(JOBS):
            conn.execute("DELETE FROM job_idempotency_keys")
            bench_db.insert_pending(client_id, 1, notify=True)

            def stream_started(n: int = n) -> bool:
                return len(fake.calls) > n and fake.calls[n].chunks_sent > 0

            def stream_closed(n: int = n) -> bool:
                return fake.calls[n].closed_at is not None

            bench_db.wait_until("the stream to start", stream_started, [worker], timeout_s=60)
            time.sleep(rng.uniform(0, HEARTBEAT_S))
            # what a client's DELETE does to the job's row
            conn.execute("UPDATE story_jobs SET status = 'failed', error_code = 'cancelled', "
                         "error_text = 'cancelled', completed_at = now(), charged_usd = 0 WHERE status = 'running'")
            cancelled_at = time.monotonic()
            bench_db.wait_until("the stream to close", stream_closed, [worker], timeout_s=30, interval_s=0.01)
            closed_at = fake.calls[n].closed_at
            assert closed_at is not None
            latencies.append(closed_at - cancelled_at)
    return latencies
