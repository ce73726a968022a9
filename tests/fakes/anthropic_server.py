"""A small Anthropic-compatible Messages API for tests, served by uvicorn in a
background thread of the test process. Its Message Batches endpoints live in
tests/fakes/anthropic_batches.py (``fake.batches``).

It streams SSE as the real API does, and does what a test asks, request by
request: answer 429/529/400/500, stall mid-stream, drop the connection, send
an error event. It records every request, and whether it was billed (a
stream was started) and whether the client closed the stream early. Those
records are how tests prove "billed at most once".
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import uvicorn

from tests.fakes.anthropic_batches import PREFIX as BATCHES_PREFIX
from tests.fakes.anthropic_batches import FakeBatches
from tests.support.waiting import wait_until_sync


@dataclass(frozen=True)
class Plan:
    """How to answer one request."""

    status: int = 200
    # streamed answers: chunks of text, spread over duration_s
    chunks: int = 8
    duration_s: float = 0.0
    words_per_chunk: int = 5
    # after this many chunks: stall for stall_s, drop the connection, or
    # send an SSE error event
    stall_after: int | None = None
    stall_s: float = 3600.0
    drop_after: int | None = None
    error_event_after: int | None = None
    retry_after_ms: int | None = None
    # x-should-retry, as the provider sends it (e.g. false on a 429 when a
    # spend limit is reached); None: no such header
    should_retry: bool | None = None
    # text of the story, instead of generated filler
    text: str | None = None
    # the input tokens reported, instead of the prompt's word count
    input_tokens: int | None = None
    # the stream waits for this before its last event, so a test decides
    # exactly when the story is finished
    hold: threading.Event | None = None
    # the output tokens the final usage (message_delta) reports, instead of
    # the count streamed: a provider bug or a proxy can send any number
    final_output_tokens: int | None = None
    # headers added to the answer as they are, whatever its status (e.g. a
    # retry-after or an anthropic-ratelimit-* header no parser expects)
    headers: tuple[tuple[str, str], ...] = ()


@dataclass
class Call:
    """One request the fake received."""

    number: int
    request_id: str
    received_at: float
    body: dict[str, Any]
    headers: dict[str, str]
    plan: Plan
    status: int = 0
    billed: bool = False  # a stream was started (message_start sent)
    limited: bool = False  # answered 429 by the account's limits
    output_tokens: int = 0
    chunks_sent: int = 0
    finished: bool = False  # message_stop sent
    closed_early: bool = False  # the client went away before message_stop
    dropped: bool = False  # we cut the connection on purpose (Plan.drop_after)
    closed_at: float | None = None

    @property
    def prompt(self) -> str:
        return _prompt_of(self.body)


def _prompt_of(body: dict[str, Any]) -> str:
    messages = body.get("messages") or [{}]
    content = messages[-1].get("content", "")
    return content if isinstance(content, str) else json.dumps(content)


class RateBucket:
    """A continuously refilling bucket, as the provider keeps one per limit:
    ``per_minute`` refills in a minute, and it holds at most burst_s of it."""

    def __init__(self, per_minute: float, burst_s: float = 60.0) -> None:
        self.per_minute = per_minute
        self.rate = per_minute / 60.0
        self.capacity = self.rate * burst_s
        self.available = self.capacity
        self._at = time.monotonic()

    def refill(self) -> float:
        now = time.monotonic()
        self.available = min(self.capacity, self.available + self.rate * (now - self._at))
        self._at = now
        return self.available

    def seconds_until(self, amount: float) -> float:
        return max(amount - self.refill(), 0.0) / self.rate

    def headers(self, name: str) -> list[tuple[bytes, bytes]]:
        """The anthropic-ratelimit-{name}-* headers: limit, what is left, and
        when the bucket is whole again (RFC 3339)."""
        full_at = time.time() + self.seconds_until(self.capacity)
        reset = datetime.fromtimestamp(full_at, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        return [(f"anthropic-ratelimit-{name}-limit".encode(), str(int(self.per_minute)).encode()),
                (f"anthropic-ratelimit-{name}-remaining".encode(), str(max(int(self.refill()), 0)).encode()),
                (f"anthropic-ratelimit-{name}-reset".encode(), reset.encode())]


@dataclass
class FakeAnthropic:
    default: Plan = field(default_factory=Plan)
    # the account's limits, enforced as the provider does: a request is
    # answered 429 (with retry-after and the anthropic-ratelimit-* headers)
    # unless one request and its max_tokens are left; the output tokens it
    # did not use are given back when its stream ends. Every answer carries
    # the headers.
    requests_per_minute: float | None = None
    output_tokens_per_minute: float | None = None
    limit_burst_s: float = 60.0
    # a provider that does not say how much is left (only its 429s do)
    send_limit_headers: bool = True
    # the least retry-after its 429s give, in whole seconds (providers round up)
    limit_retry_after_s: int = 1
    # probability of answering 529 instead of the default plan
    overload_rate: float = 0.0
    seed: int = 1234
    # the Message Batches endpoints, their plans and what they billed
    batches: FakeBatches = field(default_factory=FakeBatches)
    calls: list[Call] = field(default_factory=list)
    _queued: deque[Plan] = field(default_factory=deque)
    _queued_for: dict[str, deque[Plan]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)
        self._buckets = {
            name: RateBucket(per_minute, self.limit_burst_s)
            for name, per_minute in (("requests", self.requests_per_minute),
                                     ("output-tokens", self.output_tokens_per_minute))
            if per_minute is not None
        }

    @property
    def rate_limited(self) -> list[Call]:
        """Requests the account's limits turned away (429 not asked by a plan)."""
        with self._lock:
            return [c for c in self.calls if c.limited]

    def _admit(self, max_tokens: int) -> tuple[float | None, list[tuple[bytes, bytes]]]:
        """Takes a request and its max_tokens from the buckets: None, or the
        seconds to wait when they are short; and the headers to send."""
        with self._lock:
            needs = {"requests": 1.0, "output-tokens": float(max_tokens)}
            wait = max((bucket.seconds_until(needs[name]) for name, bucket in self._buckets.items()), default=0.0)
            if wait <= 0:
                for name, bucket in self._buckets.items():
                    bucket.available -= needs[name]
            headers = [h for name, bucket in self._buckets.items() for h in bucket.headers(name)]
        return (wait if wait > 0 else None), headers

    def _give_back(self, output_tokens: float) -> None:
        with self._lock:
            bucket = self._buckets.get("output-tokens")
            if bucket is not None:
                bucket.available = min(bucket.capacity, bucket.available + output_tokens)

    # -- what tests use --------------------------------------------------------------

    def queue(self, *plans: Plan) -> None:
        """The next requests get these plans, in order; then the default."""
        with self._lock:
            self._queued.extend(plans)

    def queue_for(self, prompt_fragment: str, *plans: Plan) -> None:
        """The next requests whose prompt holds prompt_fragment get these
        plans, in order, before any plan queued for every request."""
        with self._lock:
            self._queued_for.setdefault(prompt_fragment, deque()).extend(plans)

    @property
    def billed(self) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.billed]

    def calls_for(self, prompt_fragment: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if prompt_fragment in c.prompt]

    def wait_for(self, predicate: Any, timeout: float = 10.0) -> None:
        def seen() -> bool:
            with self._lock:
                return bool(predicate(self))

        wait_until_sync(seen, timeout=timeout, what="the fake provider to see what the test waited for")

    # -- ASGI ---------------------------------------------------------------------------

    def _next_plan(self, prompt: str) -> Plan:
        with self._lock:
            for fragment, plans in self._queued_for.items():
                if plans and fragment in prompt:
                    return plans.popleft()
            if self._queued:
                return self._queued.popleft()
            if self.overload_rate and self._random.random() < self.overload_rate:
                return Plan(status=529, retry_after_ms=50)
            return self.default

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == BATCHES_PREFIX or scope["path"].startswith(BATCHES_PREFIX + "/"):
            await self.batches.handle(scope, receive, send)
            return
        if scope["path"] != "/v1/messages" or scope["method"] != "POST":
            await _json(send, 404, {"type": "error", "error": {"type": "not_found_error", "message": "no"}})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = json.loads(b"".join(chunks) or b"{}")
        plan = self._next_plan(_prompt_of(body))
        with self._lock:
            number = len(self.calls) + 1
            call = Call(
                number=number,
                request_id=f"req_fake_{number:06d}",
                received_at=time.monotonic(),
                body=body,
                headers={k.decode(): v.decode() for k, v in scope["headers"]},
                plan=plan,
            )
            self.calls.append(call)
        await self._answer(call, body, receive, send)

    async def _answer(self, call: Call, body: dict[str, Any], receive: Any, send: Any) -> None:
        plan = call.plan
        extra = [(b"request-id", call.request_id.encode())]
        max_tokens = int(body.get("max_tokens") or 0)
        if plan.status == 200 and self._buckets:
            wait, limit_headers = self._admit(max_tokens)
            if self.send_limit_headers:
                extra += limit_headers
            if wait is not None:
                call.limited = True
                plan = Plan(status=429)
                extra.append((b"retry-after", str(max(math.ceil(wait), self.limit_retry_after_s)).encode()))
        call.status = plan.status
        if plan.retry_after_ms is not None:
            extra.append((b"retry-after-ms", str(plan.retry_after_ms).encode()))
        if plan.should_retry is not None:
            extra.append((b"x-should-retry", b"true" if plan.should_retry else b"false"))
        extra += [(name.encode(), value.encode()) for name, value in plan.headers]
        if plan.status != 200:
            kind = {429: "rate_limit_error", 529: "overloaded_error", 400: "invalid_request_error",
                    401: "authentication_error"}.get(plan.status, "api_error")
            await _json(send, plan.status, {"type": "error", "error": {"type": kind, "message": f"fake {kind}"}},
                        extra)
            return
        disconnected = asyncio.Event()

        async def watch_disconnect() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    return

        watcher = asyncio.create_task(watch_disconnect())
        try:
            await self._stream(call, body, send, disconnected, extra)
            if self._buckets:
                self._give_back(max_tokens - call.output_tokens)
        except _Drop:
            call.dropped = True
            raise  # uvicorn then closes the connection mid-response
        except (OSError, RuntimeError):
            # the client is gone
            disconnected.set()
        finally:
            watcher.cancel()
            if not call.finished and not call.dropped:
                call.closed_early = True
                call.closed_at = time.monotonic()

    async def _stream(self, call: Call, body: dict[str, Any], send: Any, disconnected: asyncio.Event,
                      extra: list[tuple[bytes, bytes]]) -> None:
        plan = call.plan
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), *extra]})
        input_tokens = plan.input_tokens or max(1, len(call.prompt.split()))
        model = body.get("model", "fake-model")

        async def event(name: str, data: dict[str, Any]) -> None:
            if disconnected.is_set():
                raise RuntimeError("client disconnected")
            payload = f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
            await send({"type": "http.response.body", "body": payload, "more_body": True})

        call.billed = True
        await event("message_start", {"type": "message_start", "message": {
            "id": f"msg_{call.number}", "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 1}}})
        await event("content_block_start", {"type": "content_block_start", "index": 0,
                                            "content_block": {"type": "text", "text": ""}})
        pieces = _pieces(plan, call.prompt)
        interval = plan.duration_s / max(len(pieces), 1)
        output_tokens = 0
        for index, piece in enumerate(pieces):
            if plan.stall_after is not None and index == plan.stall_after:
                await _sleep_or_disconnect(plan.stall_s, disconnected)
            if plan.drop_after is not None and index == plan.drop_after:
                raise _Drop("fake provider drops the connection")
            if plan.error_event_after is not None and index == plan.error_event_after:
                await event("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                call.finished = True
                return
            if interval:
                await _sleep_or_disconnect(interval, disconnected)
            await event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                "delta": {"type": "text_delta", "text": piece}})
            call.chunks_sent += 1
            output_tokens += len(piece.split())
            call.output_tokens = output_tokens
        if plan.hold is not None:
            while not plan.hold.is_set():
                await _sleep_or_disconnect(0.01, disconnected)
        await event("content_block_stop", {"type": "content_block_stop", "index": 0})
        reported = output_tokens if plan.final_output_tokens is None else plan.final_output_tokens
        await event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn",
                                                                        "stop_sequence": None},
                                      "usage": {"output_tokens": reported}})
        await event("message_stop", {"type": "message_stop"})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        call.finished = True


class _Drop(Exception):
    pass


def _pieces(plan: Plan, prompt: str) -> list[str]:
    if plan.text is not None:
        words = plan.text.split(" ")
        size = max(1, len(words) // max(plan.chunks, 1))
        return [" ".join(words[i:i + size]) + (" " if i + size < len(words) else "")
                for i in range(0, len(words), size)]
    first = "Title: A Fake Story\n"
    filler = ("sleepy " * plan.words_per_chunk)
    return [first] + [filler for _ in range(max(plan.chunks - 1, 0))]


async def _sleep_or_disconnect(seconds: float, disconnected: asyncio.Event) -> None:
    try:
        await asyncio.wait_for(disconnected.wait(), timeout=seconds)
    except TimeoutError:
        return
    raise RuntimeError("client disconnected")


async def _json(send: Any, status: int, data: dict[str, Any], extra: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = json.dumps(data).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *(extra or [])]})
    await send({"type": "http.response.body", "body": payload})


class FakeAnthropicServer:
    """Serves a FakeAnthropic on 127.0.0.1 in a thread; ``base_url`` for the SDK."""

    def __init__(self, fake: FakeAnthropic) -> None:
        self.fake = fake
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(fake, log_level="critical", lifespan="off", access_log=False,
                                loop="asyncio", http="h11", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        fake.batches.abort_connection = self._abort
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def _abort(self, scope: Any) -> bool:
        """Closes the connection of the request with this ASGI scope at once,
        without an answer, as a load balancer that loses it does. Called on
        the server's own loop."""
        client = tuple(scope.get("client") or ())
        for connection in list(self._server.server_state.connections):
            transport = getattr(connection, "transport", None)
            if getattr(connection, "client", None) == client and transport is not None:
                transport.abort()
                return True
        return False

    def __enter__(self) -> FakeAnthropicServer:
        self._thread.start()
        wait_until_sync(lambda: self._server.started, timeout=10, what="the fake provider to start")
        return self

    def __exit__(self, *_: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._socket.close()
