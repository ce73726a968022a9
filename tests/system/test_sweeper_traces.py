"""The sweeper process (``python -m sweeper``) exporting its traces over
OTLP/HTTP to a receiver on loopback, as it would to a collector."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.fakes.otlp_receiver import OtlpReceiverServer
from tests.support.database import client_id_of, enqueue
from tests.system.procs import System

pytestmark = pytest.mark.system

# the admission span of a job, as the api would have stored it
ADMISSION_TRACE = "0af7651916cd43dd8448eb211c80319c"
ADMISSION_SPAN = "b7ad6b7169203331"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiverServer]:
    with OtlpReceiverServer() as server:
        yield server


async def _a_job_waiting_too_long(conn: psycopg.AsyncConnection[Any]) -> str:
    job_id = await enqueue(conn, await client_id_of(conn), "a fox")
    carrier = {"traceparent": f"00-{ADMISSION_TRACE}-{ADMISSION_SPAN}-01"}
    await conn.execute("UPDATE story_jobs SET created_at = now() - interval '1 day', trace_context = %s::jsonb",
                       (json.dumps(carrier),))
    return str(job_id)


async def test_the_sweeper_exports_its_pass_and_a_failed_job_s_link_when_it_stops(
    system: System, receiver: OtlpReceiverServer, conn: psycopg.AsyncConnection[Any]
) -> None:
    """With OTEL_EXPORTER_OTLP_ENDPOINT at the receiver, the sweeper fails a job that waited too long and,
    when SIGTERM stops it, flushes its spans: passes from service storyjobs-sweeper, and the failed job's
    span linked to the job's stored trace, whose ids its log line carries."""
    job_id = await _a_job_waiting_too_long(conn)
    # a batch delay of an hour: the spans can only leave through the exit path's flush
    sweeper = system.sweeper(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY=3600000,
                             PENDING_TIMEOUT_S=60)
    started = sweeper.wait_for_event("tracing.started")
    assert started["service"] == "storyjobs-sweeper" and started["endpoint"] == receiver.endpoint
    reclaimed = sweeper.wait_for_event("sweeper.reclaimed")
    assert reclaimed["job_id"] == job_id
    assert receiver.receiver.received() == []

    assert sweeper.stop() == 0
    spans = receiver.wait_for_spans(lambda spans: any(s.name == "storyjobs.sweep.job_failed" for s in spans),
                                    what="the failed job's span")
    assert {span.service_name for span in spans} == {"storyjobs-sweeper"}
    passes = [span for span in spans if span.name == "storyjobs.sweep"]
    assert passes and all(span.parent_span_id is None for span in passes)
    (failed,) = [span for span in spans if span.name == "storyjobs.sweep.job_failed"]
    assert failed.attributes == {"storyjobs.job.id": job_id, "storyjobs.job.error_code": "queue_timeout"}
    assert [(link.trace_id, link.span_id) for link in failed.links] == [(ADMISSION_TRACE, ADMISSION_SPAN)]
    assert failed.trace_id != ADMISSION_TRACE
    assert (reclaimed["trace_id"], reclaimed["span_id"]) == (failed.trace_id, failed.span_id)
    (its_pass,) = [span for span in passes if span.trace_id == failed.trace_id]
    assert its_pass.attributes["storyjobs.sweep.failed.queue_timeout"] == 1


async def test_the_sweeper_sends_nothing_without_an_endpoint(
    system: System, receiver: OtlpReceiverServer, conn: psycopg.AsyncConnection[Any]
) -> None:
    """OTEL_SERVICE_NAME, a sampler and the metrics and logs endpoints at the receiver, but no traces
    endpoint: the sweeper fails the job, logs no trace ids, says nothing of tracing, and nothing reaches
    the receiver, before or after it stops."""
    job_id = await _a_job_waiting_too_long(conn)
    sweeper = system.sweeper(OTEL_SERVICE_NAME="stories", OTEL_TRACES_SAMPLER="always_on",
                             OTEL_EXPORTER_OTLP_METRICS_ENDPOINT=receiver.endpoint,
                             OTEL_EXPORTER_OTLP_LOGS_ENDPOINT=receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY=10,
                             PENDING_TIMEOUT_S=60)
    reclaimed = sweeper.wait_for_event("sweeper.reclaimed")
    assert reclaimed["job_id"] == job_id and "trace_id" not in reclaimed
    assert sweeper.stop() == 0
    assert not any(event["event"].startswith("tracing.") for event in sweeper.events())
    assert receiver.receiver.requests == []
