"""Tracing's set-up rules (shared/telemetry.py), a job's stored trace context,
and the trace ids on log lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import format_span_id, format_trace_id

from shared import telemetry
from shared.config import ConfigError
from tests.support.host import REPO

ENDPOINT = "http://127.0.0.1:9"  # never reached: these tests export to memory


@pytest.fixture(autouse=True)
def no_otel_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from an environment without any OTEL_* variable."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


@pytest.fixture
def memory() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer() -> Iterator[trace.Tracer]:
    """A tracer of a provider of the test's own (never the global one)."""
    provider = TracerProvider(shutdown_on_exit=False)
    yield provider.get_tracer("tests")
    provider.shutdown()


def provider_for(service: str, exporter: InMemorySpanExporter) -> TracerProvider:
    provider = telemetry.tracer_provider(service, exporter=exporter)
    assert provider is not None
    return provider


def finished(provider: TracerProvider, exporter: InMemorySpanExporter) -> list[str]:
    provider.force_flush()
    return [span.name for span in exporter.get_finished_spans()]


# -- when tracing is on ---------------------------------------------------------------


def test_tracing_is_off_without_an_endpoint(memory: InMemorySpanExporter) -> None:
    """With no OTEL_* variable at all there is no provider."""
    assert telemetry.tracer_provider("storyjobs-sweeper", exporter=memory) is None


def test_a_service_name_or_a_sampler_alone_turns_nothing_on(
    monkeypatch: pytest.MonkeyPatch, memory: InMemorySpanExporter
) -> None:
    """OTEL_SERVICE_NAME, a sampler, headers or a protocol without an endpoint leave tracing off."""
    monkeypatch.setenv("OTEL_SERVICE_NAME", "stories")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-team=stories")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", ENDPOINT)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert not telemetry.tracing_enabled()
    assert telemetry.tracer_provider("storyjobs-sweeper", exporter=memory) is None


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
def test_either_endpoint_turns_tracing_on(
    monkeypatch: pytest.MonkeyPatch, memory: InMemorySpanExporter, variable: str
) -> None:
    """The general OTLP endpoint and the traces one each turn tracing on, and spans reach the exporter."""
    monkeypatch.setenv(variable, ENDPOINT)
    provider = provider_for("storyjobs-sweeper", memory)
    with provider.get_tracer("tests").start_as_current_span("work"):
        pass
    assert finished(provider, memory) == ["work"]
    provider.shutdown()


def test_sdk_disabled_turns_tracing_off_even_with_an_endpoint(
    monkeypatch: pytest.MonkeyPatch, memory: InMemorySpanExporter
) -> None:
    """OTEL_SDK_DISABLED=true wins over an endpoint."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", ENDPOINT)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert telemetry.tracer_provider("storyjobs-sweeper", exporter=memory) is None


def test_the_service_name_is_the_process_s_unless_otel_service_name_says_otherwise(
    monkeypatch: pytest.MonkeyPatch, memory: InMemorySpanExporter
) -> None:
    """service.name is storyjobs-<process> by default; OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override it."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", ENDPOINT)
    assert provider_for("storyjobs-api", memory).resource.attributes["service.name"] == "storyjobs-api"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-resource,deployment.environment=staging")
    resource = provider_for("storyjobs-api", memory).resource
    assert resource.attributes["service.name"] == "from-resource"
    assert resource.attributes["deployment.environment"] == "staging"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "stories-eu")
    assert provider_for("storyjobs-api", memory).resource.attributes["service.name"] == "stories-eu"


def test_the_sampler_is_the_one_the_environment_names(
    monkeypatch: pytest.MonkeyPatch, memory: InMemorySpanExporter
) -> None:
    """OTEL_TRACES_SAMPLER=always_off is honoured: spans are made but none is recorded or exported."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", ENDPOINT)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    provider = provider_for("storyjobs-worker", memory)
    with provider.get_tracer("tests").start_as_current_span("work") as span:
        assert not span.is_recording()
    assert finished(provider, memory) == []
    provider.shutdown()


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"])
@pytest.mark.parametrize("protocol", ["grpc", "http/json"])
def test_a_protocol_other_than_http_protobuf_is_refused_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, memory: InMemorySpanExporter, variable: str, protocol: str
) -> None:
    """gRPC or JSON is refused with an error that names the variable and the one protocol accepted."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", ENDPOINT)
    monkeypatch.setenv(variable, protocol)
    with pytest.raises(ConfigError, match=rf"^{variable} must be http/protobuf \(got '{protocol}'\)"):
        telemetry.tracer_provider("storyjobs-api", exporter=memory)


def test_http_protobuf_named_explicitly_is_accepted(
    monkeypatch: pytest.MonkeyPatch, memory: InMemorySpanExporter
) -> None:
    """Both protocol variables set to http/protobuf are fine."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", ENDPOINT)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert telemetry.tracer_provider("storyjobs-api", exporter=memory) is not None


@pytest.mark.parametrize("endpoint", ["collector:4318", "grpc://collector:4317", "http://"])
def test_an_endpoint_that_is_no_http_url_is_refused(
    monkeypatch: pytest.MonkeyPatch, memory: InMemorySpanExporter, endpoint: str
) -> None:
    """An endpoint without an http(s) scheme and a host is refused, naming the variable."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    with pytest.raises(ConfigError, match=r"^OTEL_EXPORTER_OTLP_TRACES_ENDPOINT must be an http:// or https:// URL"):
        telemetry.tracer_provider("storyjobs-api", exporter=memory)


def test_a_process_with_a_refused_protocol_exits_at_start_with_one_line() -> None:
    """The sweeper with OTEL_EXPORTER_OTLP_PROTOCOL=grpc stops at start, status 2, one line naming the variable."""
    result = subprocess.run(
        [sys.executable, "-m", "sweeper"], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={"PATH": "", "PYTHONPATH": str(REPO), "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT,
             "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "LOG_FORMAT": "json"},
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("storyjobs: configuration error: OTEL_EXPORTER_OTLP_PROTOCOL must be http/protobuf")


# -- a job's trace context --------------------------------------------------------------


def test_the_carrier_is_empty_outside_any_span() -> None:
    """No current span: nothing to store with the job."""
    assert telemetry.current_context_carrier() == {}


def test_a_stored_carrier_continues_and_links_to_the_span_that_stored_it(tracer: trace.Tracer) -> None:
    """The carrier is a W3C traceparent of the current span; read back, it parents a span in the same
    trace and makes a link to the span itself."""
    with tracer.start_as_current_span("admission") as admission:
        carrier = telemetry.current_context_carrier()
    stored = json.loads(json.dumps(carrier))  # as the jsonb column gives it back
    admitted = admission.get_span_context()
    assert admitted.trace_flags.sampled
    assert stored == {"traceparent": f"00-{format_trace_id(admitted.trace_id)}-{format_span_id(admitted.span_id)}-"
                                     f"{admitted.trace_flags:02x}"}

    with tracer.start_as_current_span("run", context=telemetry.context_from_carrier(stored)) as run:
        pass
    assert run.get_span_context().trace_id == admitted.trace_id
    assert isinstance(run, ReadableSpan) and run.parent is not None and run.parent.span_id == admitted.span_id

    link = telemetry.link_from_carrier(stored, {"storyjobs.job.id": "j"})
    assert link is not None
    assert (link.context.trace_id, link.context.span_id) == (admitted.trace_id, admitted.span_id)
    assert dict(link.attributes or {}) == {"storyjobs.job.id": "j"}


def test_a_tracestate_travels_with_the_carrier(tracer: trace.Tracer) -> None:
    """A caller's tracestate is stored beside the traceparent and read back with it."""
    caller = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "vendor=abc"}
    with tracer.start_as_current_span("admission", context=telemetry.context_from_carrier(caller)):
        carrier = telemetry.current_context_carrier()
    assert carrier["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c-")
    assert carrier["tracestate"] == "vendor=abc"
    link = telemetry.link_from_carrier(carrier)
    assert link is not None and link.context.trace_state.get("vendor") == "abc"


@pytest.mark.parametrize("stored", [
    None, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", [], {}, {"traceparent": 7},
    {"traceparent": "garbage"}, {"traceparent": "00-00000000000000000000000000000000-b7ad6b7169203331-01"},
])
def test_a_stored_value_that_is_no_trace_context_links_to_nothing(stored: object) -> None:
    """NULL, a bare string, a list, a number or a malformed traceparent gives no link and no parent."""
    assert telemetry.link_from_carrier(stored) is None
    assert not trace.get_current_span(telemetry.context_from_carrier(telemetry.carrier_of(stored))) \
        .get_span_context().is_valid


# -- logs -----------------------------------------------------------------------------


def test_a_log_line_inside_a_span_carries_its_trace_and_span_ids(tracer: trace.Tracer) -> None:
    """The processor adds the current span's ids in hex inside a span, and nothing outside one."""
    assert telemetry.add_trace_ids(None, "info", {"event": "outside"}) == {"event": "outside"}
    with tracer.start_as_current_span("pass") as span:
        line = telemetry.add_trace_ids(None, "info", {"event": "inside"})
    context = span.get_span_context()
    assert line == {"event": "inside", "trace_id": format_trace_id(context.trace_id),
                    "span_id": format_span_id(context.span_id)}
    assert len(line["trace_id"]) == 32 and len(line["span_id"]) == 16


_LOG_SCRIPT = """
import logging
import structlog
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from shared import logs
logs.configure("info", "json", process="test")
tracer = TracerProvider(shutdown_on_exit=False).get_tracer("test")
log = structlog.get_logger()
log.info("before")
with tracer.start_as_current_span("pass") as span:
    log.info("inside")
    logging.getLogger("psycopg.pool").warning("from the stdlib")
    context = span.get_span_context()
    print(format(context.trace_id, "032x"), format(context.span_id, "016x"))
log.info("after")
"""


def test_the_process_log_chain_adds_the_ids_to_structlog_and_stdlib_lines() -> None:
    """With logs.configure's chain, JSON lines written inside a span (ours and a library's) carry
    trace_id and span_id; lines before and after it carry neither."""
    result = subprocess.run([sys.executable, "-c", _LOG_SCRIPT], cwd=REPO, capture_output=True, text=True,
                            env={"PATH": "", "PYTHONPATH": str(REPO)}, timeout=60, check=True)
    trace_id, span_id = result.stdout.split()
    lines = {line["event"]: line for line in map(json.loads, result.stderr.splitlines())}
    assert set(lines) == {"before", "inside", "from the stdlib", "after"}
    for event in ("inside", "from the stdlib"):
        assert (lines[event]["trace_id"], lines[event]["span_id"]) == (trace_id, span_id)
    for event in ("before", "after"):
        assert "trace_id" not in lines[event] and "span_id" not in lines[event]
