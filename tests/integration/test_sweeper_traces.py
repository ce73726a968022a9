"""The sweeper's spans on a real Postgres: a pass, its batches, a span per job
it fails linked to the job's stored trace context, and a prune linked to the
jobs it deletes."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from shared import telemetry
from sweeper.store import PgSweeperStore
from sweeper.sweep import Sweeper
from tests.fakes.recording_sweeper_store import RecordingSweeperStore
from tests.support import worker_statements
from tests.support.database import client_id_of, enqueue
from tests.support.settings import sweeper_settings
from tests.support.tracing import named


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _store_trace_context(conn: psycopg.AsyncConnection[Any], job_id: int, tracer_provider: TracerProvider) -> Any:
    """The trace context the api would have stored with the job: an admission span's; its span context."""
    with tracer_provider.get_tracer("tests.admission").start_as_current_span("admission") as admission:
        carrier = telemetry.current_context_carrier()
    await conn.execute("UPDATE story_jobs SET trace_context = %s::jsonb WHERE id = %s", (json.dumps(carrier), job_id))
    return admission.get_span_context()


async def test_a_pass_is_a_span_with_its_counts_and_each_failed_job_links_to_its_trace(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
) -> None:
    """A pass that fails a timed-out job (with a stored trace context) and a queue-timed-out one (without)
    is one storyjobs.sweep span with the counts by reason; in it a fail_stale batch span, and a
    job_failed span per job with its id and reason, the first linked to the job's admission span."""
    client = await client_id_of(conn)
    traced = await enqueue(conn, client, "a fox")
    untraced = await enqueue(conn, client, "a crow")
    result = await worker_statements.job_claim(conn, worker_id="w1", claim_limit=1, provider="offline",
                                          model="offline-writer")
    assert [job.id for job in result.claimed] == [1]
    admitted = await _store_trace_context(conn, 1, tracer_provider)
    await conn.execute("UPDATE story_jobs SET started_at = now() - interval '1 hour' WHERE id = 1")
    await conn.execute("UPDATE story_jobs SET created_at = now() - interval '1 day' WHERE id = 2")
    clock = FakeClock()
    sweeper = Sweeper(sweeper_settings(heartbeat_timeout_s=60, job_timeout_s=480, pending_timeout_s=1800),
                      PgSweeperStore(pool), clock=clock, tracer=tracer_provider.get_tracer("sweeper"))
    await sweeper.probe()
    clock.now += 61
    span_exporter.clear()
    with capture_logs(processors=[telemetry.add_trace_ids]) as logs:
        swept = await sweeper.sweep_once()
    assert (swept.timed_out, swept.queue_timeout) == (1, 1)

    (sweep,) = named(span_exporter, "storyjobs.sweep")
    assert sweep.parent is None
    assert dict(sweep.attributes or {}) == {
        "storyjobs.sweep.failed": 2, "storyjobs.sweep.failed.interrupted": 0,
        "storyjobs.sweep.failed.timed_out": 1, "storyjobs.sweep.failed.queue_timeout": 1,
        "storyjobs.sweep.pruned": 0, "storyjobs.sweep.ledger_pruned": 0, "storyjobs.sweep.judged_running": True,
        "storyjobs.jobs.pending": 0, "storyjobs.jobs.running": 0,
    }
    (batch,) = named(span_exporter, "storyjobs.sweep.fail_stale")
    assert batch.parent is not None and batch.parent.span_id == sweep.context.span_id
    assert dict(batch.attributes or {}) == {
        "storyjobs.sweep.failed": 2, "storyjobs.sweep.failed.interrupted": 0,
        "storyjobs.sweep.failed.timed_out": 1, "storyjobs.sweep.failed.queue_timeout": 1}

    failed = {span.attributes["storyjobs.job.id"]: span for span in named(span_exporter, "storyjobs.sweep.job_failed")
              if span.attributes is not None}
    assert set(failed) == {str(traced), str(untraced)}
    for span in failed.values():
        assert span.parent is not None and span.parent.span_id == batch.context.span_id
        assert span.context.trace_id == sweep.context.trace_id != admitted.trace_id
    assert dict(failed[str(traced)].attributes or {}) == {
        "storyjobs.job.id": str(traced), "storyjobs.job.error_code": "timed_out", "storyjobs.worker.id": "w1"}
    assert dict(failed[str(untraced)].attributes or {}) == {
        "storyjobs.job.id": str(untraced), "storyjobs.job.error_code": "queue_timeout"}
    assert [(link.context.trace_id, link.context.span_id) for link in failed[str(traced)].links] == [
        (admitted.trace_id, admitted.span_id)]
    assert list(failed[str(untraced)].links) == []

    # the log line about each job carries the ids of that job's span
    reclaimed = {line["job_id"]: line for line in logs if line["event"] == "sweeper.reclaimed"}
    for job_id, span in failed.items():
        assert reclaimed[job_id]["trace_id"] == f"{span.context.trace_id:032x}"
        assert reclaimed[job_id]["span_id"] == f"{span.context.span_id:016x}"


async def test_a_prune_batch_links_to_the_traces_of_the_jobs_it_deletes(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
) -> None:
    """Pruning two expired jobs, one with a stored trace context and one whose value is junk, is a
    storyjobs.sweep.prune span counting both and linking to the one trace; the batch that finds nothing
    more ends the prune."""
    client = await client_id_of(conn)
    for n in range(3):
        await enqueue(conn, client, f"story {n}")
    await conn.execute("UPDATE story_jobs SET status = 'failed', error_code = 'cancelled', "
                       "created_at = now() - interval '40 days', completed_at = now() - interval '40 days' WHERE id IN (1, 2)")
    admitted = await _store_trace_context(conn, 1, tracer_provider)
    await conn.execute("""UPDATE story_jobs SET trace_context = '["not", "a", "carrier"]' WHERE id = 2""")
    sweeper = Sweeper(sweeper_settings(job_retention_s=30 * 24 * 3600), PgSweeperStore(pool), clock=FakeClock(),
                      tracer=tracer_provider.get_tracer("sweeper"))
    span_exporter.clear()
    assert (await sweeper.sweep_once()).pruned == 2

    (sweep,) = named(span_exporter, "storyjobs.sweep")
    assert sweep.attributes is not None and sweep.attributes["storyjobs.sweep.pruned"] == 2
    first, last = named(span_exporter, "storyjobs.sweep.prune")
    assert [dict(span.attributes or {}) for span in (first, last)] == [
        {"storyjobs.sweep.pruned": 2}, {"storyjobs.sweep.pruned": 0}]
    assert first.parent is not None and first.parent.span_id == sweep.context.span_id
    assert [(link.context.trace_id, link.context.span_id) for link in first.links] == [
        (admitted.trace_id, admitted.span_id)]


async def test_a_pass_that_fails_is_an_error_span_naming_only_the_error_s_type(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
) -> None:
    """A pass whose statement fails (the table locked past the lock timeout) ends its spans with an error
    status and error.type, and no exception event whose message could quote the database."""
    sweeper = Sweeper(sweeper_settings(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0), PgSweeperStore(pool),
                      clock=FakeClock(), tracer=tracer_provider.get_tracer("sweeper"))
    async with conn.transaction():
        await conn.execute("LOCK TABLE story_jobs IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            await sweeper.sweep_once()
    (sweep,) = named(span_exporter, "storyjobs.sweep")
    assert sweep.status.status_code == StatusCode.ERROR
    assert dict(sweep.attributes or {}) == {"error.type": "LockNotAvailable"}
    assert list(sweep.events) == []


async def test_a_prune_batch_that_fails_is_an_error_span_naming_only_the_error_s_type(
    tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter,
) -> None:
    """A prune batch whose statement fails ends its span with an error status and error.type, without the
    error's message (which could quote the database) in a description or an exception event."""
    store = RecordingSweeperStore()
    store.fail_next("prune_finished", psycopg.errors.LockNotAvailable("lock timeout on job 42's row"))
    sweeper = Sweeper(sweeper_settings(), store, clock=FakeClock(), tracer=tracer_provider.get_tracer("sweeper"))
    with pytest.raises(psycopg.errors.LockNotAvailable):
        await sweeper.sweep_once()
    (prune,) = named(span_exporter, "storyjobs.sweep.prune")
    assert (prune.status.status_code, prune.status.description) == (StatusCode.ERROR, None)
    assert dict(prune.attributes or {}) == {"error.type": "LockNotAvailable"}
    assert list(prune.events) == []
