"""OpenTelemetry tracing, configured only by the standard ``OTEL_*`` variables.

On only when OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
is set (and OTEL_SDK_DISABLED is not ``true``): spans then go, in batches,
to that collector over OTLP/HTTP in protobuf, the only protocol accepted.
Everything else is the SDK's own reading of the environment: the sampler
(OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG), the resource
(OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES), the batching (OTEL_BSP_*) and
the exporter's headers, timeout, compression and certificates. No other
variable turns anything on: without an endpoint nothing of the SDK is
imported and no provider is set, so every span is the API's no-op one.

Also here: a job's trace context as text to store with it (W3C trace
context, whatever OTEL_PROPAGATORS says, so the stored form never changes),
and the structlog processor that puts the current span's ids on log lines.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, format_span_id, format_trace_id
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

from shared.config import ConfigError
from shared.config_load import exit_on_config_error

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = structlog.get_logger()

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
PROTOCOL = "http/protobuf"

# the stored form of a trace context: W3C traceparent and tracestate, not the
# propagators OTEL_PROPAGATORS names, which can change between deployments
_W3C = TraceContextTextMapPropagator()


# -- the provider --------------------------------------------------------------------


def tracing_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for traces: an OTLP endpoint is set and
    OTEL_SDK_DISABLED is not ``true``."""
    environ = os.environ if environ is None else environ
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(environ.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def _check_settings(environ: Mapping[str, str]) -> None:
    """Refuses what the exporter could not honour, naming the variable."""
    for name in PROTOCOL_VARIABLES:
        value = environ.get(name, "").strip()
        if value and value != PROTOCOL:
            raise ConfigError(f"{name} must be {PROTOCOL} (got {value!r}): storyjobs exports traces over "
                              f"OTLP/HTTP in protobuf only")
    for name in ENDPOINT_VARIABLES:
        value = environ.get(name, "").strip()
        if value and (urlsplit(value).scheme not in ("http", "https") or not urlsplit(value).hostname):
            raise ConfigError(f"{name} must be an http:// or https:// URL (got {value!r})")


def tracer_provider(service: str, *, exporter: SpanExporter | None = None) -> TracerProvider | None:
    """A provider whose spans go, batched, to the OTLP/HTTP endpoint the
    environment names (or to ``exporter``), as ``service`` unless
    OTEL_SERVICE_NAME (or service.name in OTEL_RESOURCE_ATTRIBUTES) names
    another; None when tracing is off. Sets nothing global. Raises
    ConfigError for a setting it cannot honour."""
    if not tracing_enabled():
        return None
    _check_settings(os.environ)
    # imported only when tracing is on: off, a process loads none of the SDK
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    named = OTELResourceDetector().detect().attributes.get(SERVICE_NAME)
    # the sampler is the SDK's reading of OTEL_TRACES_SAMPLER(_ARG)
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: str(named or service)}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def setup_tracing(service: str) -> TracerProvider | None:
    """For a process's ``main()``: the provider of ``tracer_provider``, set
    as the global one, or None (nothing set) when tracing is off. Raises
    ConfigError for a setting it cannot honour."""
    provider = tracer_provider(service)
    if provider is None:
        return None
    trace.set_tracer_provider(provider)
    log.info("tracing.started", service=provider.resource.attributes.get("service.name"),
             endpoint=_endpoint_shown(os.environ), sampler=provider.sampler.get_description())
    return provider


def setup_tracing_or_exit(service: str) -> TracerProvider | None:
    """``setup_tracing`` at a process's start: a setting it cannot honour
    exits with one line naming the variable, as a bad setting does."""
    try:
        return setup_tracing(service)
    except ConfigError as exc:
        exit_on_config_error(exc)


def shutdown_tracing(provider: TracerProvider | None) -> None:
    """At a process's exit: exports the spans still batched (within the
    exporter's timeout) and stops the exporter. None: nothing to do."""
    if provider is not None:
        provider.shutdown()


def _endpoint_shown(environ: Mapping[str, str]) -> str:
    # scheme, host, port and path only: a URL's user-info or query may hold a token
    for name in ENDPOINT_VARIABLES:
        if value := environ.get(name, "").strip():
            parts = urlsplit(value)
            port = f":{parts.port}" if parts.port else ""
            return f"{parts.scheme}://{parts.hostname}{port}{parts.path}"
    return ""


# -- a job's trace context, stored as text ---------------------------------------------


def current_context_carrier() -> dict[str, str]:
    """The current span's trace context as W3C headers (``traceparent``,
    and ``tracestate`` when it has one), to store with a job; empty when no
    span is current (tracing off, or outside any span)."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier)
    return carrier


def carrier_of(stored: object) -> dict[str, str]:
    """A stored carrier as read back (a jsonb value: anything a column can
    hold) reduced to its text entries; empty for anything else."""
    if not isinstance(stored, Mapping):
        return {}
    return {key: value for key, value in stored.items() if isinstance(key, str) and isinstance(value, str)}


def context_from_carrier(carrier: Mapping[str, str]) -> Context:
    """The context a stored carrier holds, to start a span in the job's trace
    (its parent the span that stored it); an empty context when it holds
    none valid."""
    return _W3C.extract(carrier_of(carrier))


def link_from_carrier(stored: object, attributes: Attributes = None) -> Link | None:
    """A link to the span whose context a stored carrier holds, for a span of
    another trace about the same job; None when it holds none valid."""
    span_context = trace.get_current_span(context_from_carrier(carrier_of(stored))).get_span_context()
    if not span_context.is_valid:
        return None
    return Link(span_context, attributes)


# -- logs ----------------------------------------------------------------------------


def add_trace_ids(_logger: object, _method: str, event_dict: structlog.typing.EventDict) -> structlog.typing.EventDict:
    """structlog processor: ``trace_id`` and ``span_id`` (hex, as trace
    backends show them) on a line written while a span is current. Without a
    provider it costs one context lookup (about 0.4 µs)."""
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        event_dict["trace_id"] = format_trace_id(span_context.trace_id)
        event_dict["span_id"] = format_span_id(span_context.span_id)
    return event_dict
