"""A small OTLP/HTTP trace receiver for tests, served by uvicorn in a
background thread of the test process.

It answers ``POST /v1/traces`` as a collector does (protobuf, gzip when the
exporter compresses), decodes each request with opentelemetry-proto's own
ExportTraceServiceRequest, and keeps every span it received, flattened, for
tests to read: ids in hex, attributes as Python values, the service.name of
the resource that sent it. It also counts every request that reached it, on
any path, so a test can prove that nothing was sent.
"""

from __future__ import annotations

import gzip
import socket
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tests.support.waiting import wait_until_sync

_KINDS = {
    Span.SPAN_KIND_UNSPECIFIED: "unspecified",
    Span.SPAN_KIND_INTERNAL: "internal",
    Span.SPAN_KIND_SERVER: "server",
    Span.SPAN_KIND_CLIENT: "client",
    Span.SPAN_KIND_PRODUCER: "producer",
    Span.SPAN_KIND_CONSUMER: "consumer",
}
_STATUSES = {
    Status.STATUS_CODE_UNSET: "unset",
    Status.STATUS_CODE_OK: "ok",
    Status.STATUS_CODE_ERROR: "error",
}


@dataclass(frozen=True)
class ReceivedEvent:
    name: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class ReceivedLink:
    trace_id: str
    span_id: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the receiver decoded it; ids in lowercase hex."""

    trace_id: str
    span_id: str
    # None for a root span
    parent_span_id: str | None
    name: str
    kind: str
    attributes: dict[str, Any]
    events: tuple[ReceivedEvent, ...]
    links: tuple[ReceivedLink, ...]
    status: str
    status_message: str
    service_name: str | None
    scope: str


@dataclass(frozen=True)
class ReceivedRequest:
    method: str
    path: str
    headers: dict[str, str]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    pair: KeyValue
    for pair in pairs:
        found[pair.key] = _value(pair.value)
    return found


def decode(body: bytes) -> list[ReceivedSpan]:
    """The spans of one ExportTraceServiceRequest, flattened."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        service = _attributes(resource_spans.resource.attributes).get("service.name")
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex() or None,
                    name=span.name,
                    kind=_KINDS.get(span.kind, str(span.kind)),
                    attributes=_attributes(span.attributes),
                    events=tuple(ReceivedEvent(event.name, _attributes(event.attributes)) for event in span.events),
                    links=tuple(ReceivedLink(link.trace_id.hex(), link.span_id.hex(), _attributes(link.attributes))
                                for link in span.links),
                    status=_STATUSES.get(span.status.code, str(span.status.code)),
                    status_message=span.status.message,
                    service_name=service,
                    scope=scope_spans.scope.name,
                ))
    return spans


def _decompressed(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    return body


@dataclass
class OtlpReceiver:
    """The ASGI app: keeps what it received."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: list[ReceivedRequest] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        with self._lock:
            self.requests.append(ReceivedRequest(scope["method"], scope["path"], headers))
        if scope["method"] != "POST" or scope["path"] != "/v1/traces":
            await _answer(send, 404, b"", "text/plain")
            return
        if headers.get("content-type", "").split(";")[0].strip() != "application/x-protobuf":
            await _answer(send, 415, b"", "text/plain")
            return
        spans = decode(_decompressed(body, headers.get("content-encoding", "")))
        with self._lock:
            self.spans.extend(spans)
        await _answer(send, 200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")

    def received(self) -> list[ReceivedSpan]:
        """A copy of the spans received so far."""
        with self._lock:
            return list(self.spans)

    def named(self, name: str) -> list[ReceivedSpan]:
        return [span for span in self.received() if span.name == name]


async def _answer(send: Any, status: int, body: bytes, content_type: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class OtlpReceiverServer:
    """Serves an OtlpReceiver on 127.0.0.1 in a thread; ``endpoint`` for
    OTEL_EXPORTER_OTLP_ENDPOINT (the exporter adds /v1/traces)."""

    def __init__(self, receiver: OtlpReceiver | None = None, *, port: int = 0) -> None:
        self.receiver = receiver or OtlpReceiver()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", port))
        self.port = self._socket.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.receiver, log_level="critical", lifespan="off", access_log=False,
                                loop="asyncio", http="h11", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> OtlpReceiverServer:
        self._thread.start()
        wait_until_sync(lambda: self._server.started, timeout=10, what="the OTLP receiver to start")
        return self

    def __exit__(self, *_: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._socket.close()

    def wait_for_spans(self, check: Callable[[list[ReceivedSpan]], bool], *, timeout: float = 10.0,
                       what: str = "spans") -> list[ReceivedSpan]:
        """The spans received, once ``check`` holds for them; TimeoutError naming ``what`` otherwise."""
        wait_until_sync(lambda: check(self.receiver.received()), timeout=timeout, what=what)
        return self.receiver.received()
