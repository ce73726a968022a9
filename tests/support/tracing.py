"""Spans for the tests: a provider of a test's own (the global one stays
unset), exporting each span to memory as it ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@pytest.fixture
def span_exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer_provider(span_exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    """A provider of the test's own, exporting each span as it ends."""
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    yield provider
    provider.shutdown()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def every_attribute_text(exporter: InMemorySpanExporter) -> str:
    """Every attribute and event attribute of every span, as one text: what a
    test searches for a prompt, a story or a secret that must not be there."""
    parts = []
    for span in exporter.get_finished_spans():
        parts.append(repr(dict(span.attributes or {})))
        parts.extend(repr(dict(event.attributes or {})) for event in span.events)
    return "\n".join(parts)
