"""webhooks: how many webhook deliveries one worker process makes a second
to a local receiver (tests/fakes/webhook_receiver.py, which verifies each
signature with the standardwebhooks package on a thread per request).

A backlog of events (deliveries written straight into the outbox, as the
trigger writes them) waits before the worker starts; throughput is the count
over the span from the first attempt to the last delivery, by the database's
clock, at the default WEBHOOK_CONCURRENCY and at 16. Each attempt resolves
the host, opens a new connection and sends one request.
"""

from __future__ import annotations

from shared import webhooks
from tests.bench.harness import BenchContext, BenchResult, FigureSpec
from tests.fakes.webhook_receiver import WebhookReceiver

NAME = "webhooks"
SPECS = {
    "per_s_concurrency_4": FigureSpec("webhook deliveries per second, one worker, WEBHOOK_CONCURRENCY=4", "/s"),
    "per_s_concurrency_16": FigureSpec("webhook deliveries per second, one worker, WEBHOOK_CONCURRENCY=16", "/s"),
}
EVENTS, QUICK_EVENTS = 2000, 200

_BACKLOG = """
INSERT INTO webhook_deliveries (endpoint_id, client_id, job_id, job_public_id, job_status, error_code, occurred_at)
SELECT e.id, e.client_id, n, gen_random_uuid(), 'failed', 'cancelled', now()
FROM generate_series(1, %(count)s) AS n, webhook_endpoints e
WHERE e.id = %(endpoint_id)s
"""
_SPAN_S = """
SELECT extract(epoch FROM max(delivered_at) - min(last_attempt_at))::float8 FROM webhook_deliveries
"""


def run(ctx: BenchContext, result: BenchResult) -> None:
    count = QUICK_EVENTS if ctx.quick else EVENTS
    result.params.update({"events": count, "receiver": "http.server on 127.0.0.1, verifying with standardwebhooks"})
    for run_number in range(1, ctx.runs + 1):
        for key, concurrency in (("per_s_concurrency_4", 4), ("per_s_concurrency_16", 16)):
            per_s = _deliveries_per_s(ctx, count, concurrency)
            result.add(key, per_s)
            ctx.progress(f"webhooks run {run_number}/{ctx.runs}: concurrency {concurrency}: {per_s:,.0f}/s")


def _deliveries_per_s(ctx: BenchContext, count: int, concurrency: int) -> float:
    with ctx.database("webhooks") as bench_db, WebhookReceiver() as receiver:
        client_id = bench_db.create_client()
        secret = webhooks.new_secret()
        receiver.secrets.append(secret)
        endpoint_id = bench_db.scalar(
            "INSERT INTO webhook_endpoints (client_id, url, events, secret) "
            "VALUES (%(client_id)s, %(url)s, %(events)s, %(secret)s) RETURNING id",
            {"client_id": client_id, "url": receiver.url, "events": list(webhooks.EVENTS), "secret": secret})
        bench_db.scalar(_BACKLOG + " RETURNING 1", {"endpoint_id": endpoint_id, "count": count})
        with ctx.processes(bench_db, OFFLINE_DELAY_S=0, WEBHOOK_ALLOW_PRIVATE="true",
                           WEBHOOK_CONCURRENCY=concurrency, WEBHOOK_POLL_INTERVAL_S=0.05) as system:
            worker = system.worker(wait=False)
            bench_db.wait_until(
                "every delivery", lambda: bench_db.scalar(
                    "SELECT count(*) FROM webhook_deliveries WHERE state = 'delivered'") == count,
                [worker], timeout_s=300)
        if not all(r.verified for r in receiver.deliveries(None)):
            raise RuntimeError("a delivery failed the receiver's signature check")
        return count / float(bench_db.scalar(_SPAN_S))
