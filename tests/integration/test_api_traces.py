"""The api's traces through Litestar's OpenTelemetry plugin, with a provider
of the test's own: a client's ``traceparent`` continued by the server span,
named by its route (never a job's id); the job's trace context stored with
it; the admission batch a span linked to each job's trace; probes and
scrapes making no span; and no plugin at all without a provider."""

from __future__ import annotations

import json
from typing import Any

import psycopg
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from psycopg_pool import AsyncConnectionPool

from tests.support.api_client import api_client, new_key
from tests.support.database import create_key
from tests.support.tracing import named

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


async def test_a_posts_traceparent_is_continued_and_stored_with_its_job(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
) -> None:
    """POST /stories/generate with a traceparent: its server span is the client span's child, named by the
    route; the job stores a trace context of that trace; the admission is a span linked to it."""
    key = await create_key(conn, "parent")
    async with api_client(pool, key, tracer_provider=tracer_provider) as client:
        answer = await client.post("/stories/generate", json={"prompt": "a tired owl"},
                                   headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", **new_key()})
        polled = await client.get(answer.headers["location"])
        assert (await client.get("/healthz")).status_code == 200
    assert answer.status_code == 202 and polled.status_code == 200
    (server,) = named(span_exporter, "POST /stories/generate")
    assert server.kind is SpanKind.SERVER and server.context is not None and server.parent is not None
    assert (format(server.context.trace_id, "032x"), format(server.parent.span_id, "016x")) == (TRACE_ID, CLIENT_SPAN)
    assert dict(server.attributes or {})["http.route"] == "/stories/generate"
    cur = await conn.execute("SELECT trace_context FROM story_jobs")
    ((stored,),) = await cur.fetchall()
    assert stored["traceparent"].split("-")[1] == TRACE_ID, stored
    (admission,) = named(span_exporter, "storyjobs.admission")
    assert [format(link.context.trace_id, "032x") for link in admission.links] == [TRACE_ID]
    (poll,) = named(span_exporter, "GET /stories/jobs/{job_id}")
    assert str(json.loads(answer.text)["job_id"]) not in poll.name
    assert not [span for span in span_exporter.get_finished_spans() if "healthz" in span.name]


async def test_without_a_provider_the_api_makes_no_span_and_stores_no_trace(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], span_exporter: InMemorySpanExporter,
) -> None:
    """Tracing off: a POST with a traceparent is served, nothing is exported, and the job stores no trace."""
    key = await create_key(conn, "parent")
    async with api_client(pool, key) as client:
        answer = await client.post("/stories/generate", json={"prompt": "a tired owl"},
                                   headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", **new_key()})
    assert answer.status_code == 202
    assert span_exporter.get_finished_spans() == ()
    cur = await conn.execute("SELECT trace_context FROM story_jobs")
    assert await cur.fetchall() == [(None,)]
