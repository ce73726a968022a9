"""The api's traces (docs/operations.md, "Traces"): Litestar's own
OpenTelemetry plugin, which continues a client's ``traceparent`` as the
request's server span, and names each span by its route, never its path (a
job's id in a span name would make every name unique). Health checks and
metrics scrapes make no span. Off unless the process set up tracing
(shared/telemetry.py): then nothing here is added to the app at all.
"""

from __future__ import annotations

from typing import Any

from litestar.plugins.opentelemetry import OpenTelemetryConfig, OpenTelemetryPlugin
from litestar.types import ASGIApp, Receive, Scope, Send
from opentelemetry import trace
from opentelemetry.trace import TracerProvider

# the paths that make no span: probes and scrapes, every few seconds
UNTRACED_PATHS = ["^/healthz$", "^/readyz$", "^/metrics$"]


def plugin(tracer_provider: TracerProvider) -> OpenTelemetryPlugin:
    return OpenTelemetryPlugin(OpenTelemetryConfig(
        tracer_provider=tracer_provider,
        scope_span_details_extractor=_method_only,
        exclude=UNTRACED_PATHS,
        # a span per ASGI message would triple every request's spans
        exclude_spans=["receive", "send"],
    ))


def _method_only(scope: Any) -> tuple[str, dict[str, Any]]:
    """The span's name before routing: the method alone; the route is
    added by route_span_name once the router has found it."""
    return str(scope.get("method", "HTTP")), {}


def route_span_name(app: ASGIApp) -> ASGIApp:
    """Middleware (after routing): the server span named ``METHOD
    /stories/jobs/{job_id:str}``, and its ``http.route``."""

    async def named(scope: Scope, receive: Receive, send: Send) -> None:
        span = trace.get_current_span()
        template = scope.get("path_template")
        method = scope.get("method")
        if span.is_recording() and template and method:
            span.update_name(f"{method} {template}")
            span.set_attribute("http.route", template)
        await app(scope, receive, send)

    return named
