"""Webhook attempts as spans, on Postgres with a real receiver: a job's
trace context travels with its event (the outbox's trigger copies it); the
first attempt is a span in the job's trace, a retry a trace of its own
linked to it; each says its status code and attempt, and none carries the
URL or the secret, nor sends a traceparent to the receiver."""

from __future__ import annotations

from typing import Any

import psycopg
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from psycopg_pool import AsyncConnectionPool

from api.store import ApiStore
from shared import webhooks
from tests.fakes.webhook_receiver import WebhookReceiver
from tests.support.database import client_id_of, enqueue
from tests.support.deliveries import delivering
from tests.support.settings import worker_settings
from tests.support.tracing import every_attribute_text, named
from tests.support.waiting import wait_until
from worker.delivery.loop import Deliverer
from worker.delivery.store import PgDeliveryStore


async def test_a_webhooks_first_attempt_joins_the_jobs_trace_and_a_retry_links_to_it(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
) -> None:
    """The receiver answers 500, then 204: attempt 1 is a child of the job's admitting span, in error with
    status 500; attempt 2 starts a trace of its own linked to the job's, delivered with 204."""
    client = await client_id_of(conn)
    with WebhookReceiver() as receiver:
        secret = webhooks.new_secret()
        receiver.secrets.append(secret)
        await ApiStore(conn).webhook_endpoint_insert(client_id=client, url=receiver.url, events=webhooks.EVENTS,
                                                     secret=secret, max_per_client=10)
        with tracer_provider.get_tracer("api").start_as_current_span("POST /stories/generate") as admitting:
            job = await enqueue(conn, client, "an owl")
        await ApiStore(conn).job_cancel(client_id=client, job_id=job)
        receiver.answer("fail")
        # the first retry half a second after the first attempt: time to answer otherwise
        deliverer = Deliverer(worker_settings(webhook_allow_private=True, webhook_retry_scale=0.1,
                                              webhook_poll_interval_s=0.05),
                              PgDeliveryStore(pool), tracer=tracer_provider.get_tracer("worker"))
        async with delivering(deliverer):
            await wait_until(lambda: _attempts(span_exporter, 1), what="the first attempt")
            receiver.answer("ok")
            await wait_until(lambda: _attempts(span_exporter, 2), what="the retry")
    first, retry = sorted(named(span_exporter, "storyjobs.webhook.attempt"),
                          key=lambda s: str(dict(s.attributes or {})["storyjobs.webhook.attempt"]))
    job_trace = admitting.get_span_context()
    assert first.kind is SpanKind.CLIENT and first.context is not None and first.parent is not None
    assert (first.context.trace_id, first.parent.span_id) == (job_trace.trace_id, job_trace.span_id)
    assert first.status.status_code is StatusCode.ERROR
    assert dict(first.attributes or {})["http.response.status_code"] == 500
    assert retry.context is not None and retry.context.trace_id != job_trace.trace_id and retry.parent is None
    assert [link.context.trace_id for link in retry.links] == [job_trace.trace_id]
    assert dict(retry.attributes or {})["http.response.status_code"] == 204
    text = every_attribute_text(span_exporter)
    assert receiver.url not in text and secret not in text
    assert all("traceparent" not in delivery.headers for delivery in receiver.received)


async def _attempts(exporter: InMemorySpanExporter, n: int) -> bool:
    return len(named(exporter, "storyjobs.webhook.attempt")) >= n
