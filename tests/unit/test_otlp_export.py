"""Tracing as a process sets it up (shared/telemetry.setup_tracing), exporting
over OTLP/HTTP to a receiver on loopback (tests/fakes/otlp_receiver.py), and
sending nothing at all without an endpoint."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.fakes.otlp_receiver import OtlpReceiverServer
from tests.support.host import REPO

# One process's life with tracing: set up, spans, the exit path's shutdown.
# The batch delay is an hour, so the spans can only arrive through the
# shutdown's flush.
_TRACED_SCRIPT = """
import json, sys
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode
from shared import telemetry

provider = telemetry.setup_tracing("storyjobs-sweeper")
tracer = trace.get_tracer("tests.export")
with tracer.start_as_current_span("admission", kind=SpanKind.SERVER) as admission:
    carrier = telemetry.current_context_carrier()
with tracer.start_as_current_span(
    "storyjobs.sweep", links=[telemetry.link_from_carrier(carrier, {"storyjobs.job.id": "j-1"})],
    attributes={"storyjobs.sweep.failed": 2, "storyjobs.sweep.judged_running": True, "ratio": 0.5,
                "reasons": ["interrupted", "timed_out"]},
) as sweep:
    sweep.add_event("provider.overloaded", {"retry_after_s": 3.0})
    with tracer.start_as_current_span("storyjobs.sweep.fail_stale", kind=SpanKind.CLIENT):
        pass
    sweep.set_status(StatusCode.ERROR, "database unreachable")
telemetry.shutdown_tracing(provider)
print(json.dumps({"admission": format(admission.get_span_context().span_id, "016x"),
                  "trace": format(admission.get_span_context().trace_id, "032x")}))
"""

# The same process without an endpoint: every other OTEL_* variable set.
_UNTRACED_SCRIPT = """
import json, sys
from opentelemetry import trace
from shared import telemetry

provider = telemetry.setup_tracing("storyjobs-sweeper")
with trace.get_tracer("tests.export").start_as_current_span("storyjobs.sweep") as span:
    recording = span.is_recording()
    carrier = telemetry.current_context_carrier()
telemetry.shutdown_tracing(provider)
print(json.dumps({
    "provider": provider is not None,
    "global": type(trace.get_tracer_provider()).__name__,
    "recording": recording,
    "carrier": carrier,
    "sdk_loaded": sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))),
}))
"""


def _run(script: str, env: dict[str, str]) -> dict[str, object]:
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={"PATH": "", "PYTHONPATH": str(REPO), **env})
    assert result.returncode == 0, result.stderr
    # the last line: structlog, not configured here, writes its lines to stdout too
    answer: dict[str, object] = json.loads(result.stdout.splitlines()[-1])
    return answer


@pytest.fixture
def receiver() -> Iterator[OtlpReceiverServer]:
    with OtlpReceiverServer() as server:
        yield server


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_spans_reach_the_collector_decoded_when_the_process_exits(
    receiver: OtlpReceiverServer, compression: str
) -> None:
    """With OTEL_EXPORTER_OTLP_ENDPOINT set, the spans of a process arrive at /v1/traces as protobuf (gzipped
    when asked) at its shutdown, under service storyjobs-sweeper, with their parents, kinds, attributes,
    events, links and status."""
    ids = _run(_TRACED_SCRIPT, {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                                "OTEL_EXPORTER_OTLP_COMPRESSION": compression,
                                "OTEL_BSP_SCHEDULE_DELAY": "3600000"})
    spans = {span.name: span for span in receiver.receiver.received()}
    assert set(spans) == {"admission", "storyjobs.sweep", "storyjobs.sweep.fail_stale"}
    requests = receiver.receiver.requests
    assert [(r.method, r.path, r.headers["content-type"]) for r in requests] == [
        ("POST", "/v1/traces", "application/x-protobuf")]
    assert requests[0].headers.get("content-encoding") == ("gzip" if compression == "gzip" else None)

    admission, sweep, child = spans["admission"], spans["storyjobs.sweep"], spans["storyjobs.sweep.fail_stale"]
    assert {span.service_name for span in spans.values()} == {"storyjobs-sweeper"}
    assert {span.scope for span in spans.values()} == {"tests.export"}
    assert (admission.trace_id, admission.span_id) == (ids["trace"], ids["admission"])
    assert (admission.kind, sweep.kind, child.kind) == ("server", "internal", "client")
    # the sweep is a trace of its own, linked to the admission's; its child is in it
    assert sweep.parent_span_id is None and sweep.trace_id != admission.trace_id
    assert (child.trace_id, child.parent_span_id) == (sweep.trace_id, sweep.span_id)
    assert [(link.trace_id, link.span_id, link.attributes) for link in sweep.links] == [
        (admission.trace_id, admission.span_id, {"storyjobs.job.id": "j-1"})]
    assert sweep.attributes == {"storyjobs.sweep.failed": 2, "storyjobs.sweep.judged_running": True,
                                "ratio": 0.5, "reasons": ["interrupted", "timed_out"]}
    assert [(event.name, event.attributes) for event in sweep.events] == [
        ("provider.overloaded", {"retry_after_s": 3.0})]
    assert (sweep.status, sweep.status_message) == ("error", "database unreachable")
    assert child.status == "unset"


def _default_port_receiver() -> OtlpReceiverServer | None:
    """A receiver on the exporter's default port (4318), where an exporter made without an endpoint would
    send; None when something else holds the port."""
    try:
        return OtlpReceiverServer(port=4318)
    except OSError:
        return None


def test_without_an_endpoint_nothing_is_sent_nor_loaded(receiver: OtlpReceiverServer) -> None:
    """Every OTEL_* variable but the endpoints (the metrics and logs endpoints at the receiver): no request
    reaches any receiver, no provider is set, spans do not record, no trace context is stored, and neither
    the SDK nor the exporter is imported."""
    at_default = _default_port_receiver()
    receivers = [receiver, *([at_default.__enter__()] if at_default is not None else [])]
    try:
        answer = _run(_UNTRACED_SCRIPT, {
            "OTEL_SERVICE_NAME": "stories", "OTEL_TRACES_SAMPLER": "always_on",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_HEADERS": "x-team=stories",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": receiver.endpoint,
            "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "10",
        })
    finally:
        if at_default is not None:
            at_default.__exit__(None, None, None)
    assert answer == {"provider": False, "global": "ProxyTracerProvider", "recording": False, "carrier": {},
                      "sdk_loaded": []}
    assert [server.receiver.requests for server in receivers] == [[] for _ in receivers]


def test_the_receiver_answers_only_otlp_traces(receiver: OtlpReceiverServer) -> None:
    """Another path is a 404 and a body that is not protobuf a 415, and neither adds a span, but both are
    counted as requests received."""
    with socket.create_connection(("127.0.0.1", receiver.port)) as sock:
        sock.sendall(b"POST /v1/metrics HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                     b"Content-Length: 0\r\nConnection: close\r\n\r\n")
        assert sock.makefile("rb").readline().startswith(b"HTTP/1.1 404")
    with socket.create_connection(("127.0.0.1", receiver.port)) as sock:
        sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
        assert sock.makefile("rb").readline().startswith(b"HTTP/1.1 415")
    assert [request.path for request in receiver.receiver.requests] == ["/v1/metrics", "/v1/traces"]
    assert receiver.receiver.received() == []
