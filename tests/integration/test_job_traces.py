"""A job's run as a trace, on Postgres with the real ``anthropic`` SDK
against the fake provider: the run is a span in the trace of the request
that admitted the job, each attempt the SDK's own span inside it, the waits
after a 429 events on it; no prompt or story in any attribute, whatever the
environment asks of the SDK, and no trace context sent to the provider."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from psycopg_pool import AsyncConnectionPool

from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer, Plan
from tests.support.database import client_id_of, enqueue, job_rows
from tests.support.settings import worker_settings
from tests.support.tracing import every_attribute_text, named
from tests.support.waiting import wait_until
from worker.anthropic_writer import AnthropicWriter
from worker.coordinator import Coordinator
from worker.pg_store import PgWorkerStore

PROMPT = "a walrus who collects moonbeams"
STORY = "Title: Moonbeams\nThe walrus kept every moonbeam in a jar by the sea."


@pytest.fixture
async def provider_server() -> AsyncIterator[FakeAnthropicServer]:
    with FakeAnthropicServer(FakeAnthropic(default=Plan(chunks=4, text=STORY))) as server:
        yield server


async def _run(conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, server: FakeAnthropicServer,
               tracer_provider: TracerProvider) -> Any:
    """One job admitted inside a span (as the api admits it), run by a worker that traces; the admitting span."""
    settings = worker_settings(anthropic_api_key="test", anthropic_base_url=server.base_url)
    writer = AnthropicWriter(settings, tracer_provider=tracer_provider)
    store = PgWorkerStore(pool, worker_id="w-traced", provider=writer.provider, model=writer.model,
                          default_max_tokens=settings.llm_max_tokens)
    worker = Coordinator(settings, store, writer, listen=False, tracer=tracer_provider.get_tracer("worker"))
    client = await client_id_of(conn)
    with tracer_provider.get_tracer("api").start_as_current_span("POST /stories/generate") as admitting:
        await enqueue(conn, client, PROMPT)
    try:
        while not all(r.status in ("completed", "failed") for r in await job_rows(conn)):
            result = await worker.round_once()
            await wait_until(lambda: _quiet(worker), what="the job's call to end", timeout=20)
            assert result.database_error is None
    finally:
        await writer.aclose()
    return admitting


async def _quiet(worker: Coordinator) -> bool:
    return all(not held.running for held in worker.held)


async def test_a_jobs_run_and_its_attempts_are_in_the_trace_of_the_request_that_admitted_it(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, provider_server: FakeAnthropicServer,
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 429 then a story: the run span's parent is the admitting span; the SDK's two attempt spans are its
    children; the wait is an event on it; it says the finish reason, the usage, two attempts, billed."""
    monkeypatch.setenv("ANTHROPIC_OPEN_TELEMETRY_TRACES_CONTENT_MODE", "content")
    provider_server.fake.queue(Plan(status=429, retry_after_ms=20))
    admitting = await _run(conn, pool, provider_server, tracer_provider)
    (run,) = named(span_exporter, "storyjobs.job.run")
    attempts = named(span_exporter, "anthropic.messages.create")
    trace_id = admitting.get_span_context().trace_id
    assert run.context is not None and run.context.trace_id == trace_id
    assert run.parent is not None and run.parent.span_id == admitting.get_span_context().span_id
    assert len(attempts) == 2
    for attempt in attempts:
        assert attempt.kind is SpanKind.CLIENT and attempt.parent is not None
        assert attempt.parent.span_id == run.context.span_id
    assert [a.attributes.get("error.type") for a in attempts if a.attributes] == ["rate_limit_error", None]
    attributes = dict(run.attributes or {})
    assert attributes["gen_ai.response.finish_reasons"] == ("end_turn",)
    assert attributes["storyjobs.llm.attempts"] == 2 and attributes["storyjobs.llm.billed"] is True
    assert int(attributes["gen_ai.usage.output_tokens"]) > 0  # type: ignore[arg-type]
    (wait,) = [event for event in run.events if event.name == "storyjobs.llm.retry_wait"]
    assert dict(wait.attributes or {})["storyjobs.llm.outcome"] == "rate_limited"
    text = every_attribute_text(span_exporter)
    assert PROMPT not in text and "moonbeam in a jar" not in text
    assert all("traceparent" not in call.headers for call in provider_server.fake.calls)


async def test_a_job_the_provider_refuses_ends_its_run_span_in_error(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, provider_server: FakeAnthropicServer,
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter,
) -> None:
    """A 400: the run span has error.type llm_rejected and an error status, billed false."""
    provider_server.fake.queue(Plan(status=400))
    await _run(conn, pool, provider_server, tracer_provider)
    (run,) = named(span_exporter, "storyjobs.job.run")
    assert run.status.status_code is StatusCode.ERROR
    attributes = dict(run.attributes or {})
    assert (attributes["error.type"], attributes["storyjobs.llm.billed"]) == ("llm_rejected", False)
