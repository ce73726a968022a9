"""A webhook receiver for the tests: a small HTTP server on 127.0.0.1 that
verifies every delivery with the ``standardwebhooks`` package (the spec's own
library, not storyjobs' code), records it, and answers as the test says:
``ok`` (204), ``fail`` (500), ``gone`` (410), ``retry_after`` (503 with
``Retry-After``), ``hang`` (holds the request until told otherwise),
``redirect`` (302 to ``redirect_to``), ``ok_200`` (200), ``multiple_choices``
(300, no redirect). ``stop()`` and ``start()`` take it off
and back onto its port, as a receiver that is down for a while.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

import msgspec
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from tests.support.host import free_port


class Received(msgspec.Struct, frozen=True):
    path: str
    msg_id: str
    headers: dict[str, str]
    body: dict[str, Any]
    raw: bytes
    # whether one of the endpoint's secrets verified the signature
    verified: bool
    # what the receiver answered
    status: int


class WebhookReceiver:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.secrets: list[str] = []
        self.mode = "ok"
        self.retry_after = "1"
        self.redirect_to = "http://169.254.169.254/latest/meta-data/"
        self.received: list[Received] = []
        self._lock = threading.Lock()
        # set while ``hang`` holds requests; cleared by a change of mode
        self._release = threading.Event()
        self.hanging = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def answer(self, mode: str) -> None:
        self.mode = mode
        if mode != "hang":
            self._release.set()

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                receiver._handle(self)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                return

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="webhook-receiver", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops listening: connections are refused until ``start()``."""
        self._release.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    # -- what the tests read ---------------------------------------------------------

    def deliveries(self, status: int | None = 204) -> list[Received]:
        """What was received (and answered with ``status``; None: all)."""
        with self._lock:
            return [r for r in self.received if status is None or r.status == status]

    def delivered_ids(self) -> Counter[str]:
        """webhook-id -> how many times it was delivered (answered 2xx)."""
        return Counter(r.msg_id for r in self.deliveries())

    # -- the server --------------------------------------------------------------------

    def _verify(self, body: bytes, headers: dict[str, str]) -> bool:
        for secret in self.secrets:
            try:
                Webhook(secret).verify(body, headers)
            except WebhookVerificationError:
                continue
            return True
        return False

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        length = int(request.headers.get("content-length") or 0)
        raw = request.rfile.read(length)
        headers = {k.lower(): v for k, v in request.headers.items()}
        mode = self.mode
        if mode == "hang":
            with self._lock:
                self.hanging += 1
            self._release.clear()
            self._release.wait(timeout=60)
            with self._lock:
                self.hanging -= 1
            mode = self.mode if self.mode != "hang" else "fail"
        status = {"ok": 204, "ok_200": 200, "fail": 500, "gone": 410, "retry_after": 503, "redirect": 302,
                  "multiple_choices": 300}[mode]
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        with self._lock:
            self.received.append(Received(
                path=request.path, msg_id=headers.get("webhook-id", ""), headers=headers, body=body, raw=raw,
                verified=self._verify(raw, headers), status=status))
        try:
            request.send_response(status)
            if mode == "retry_after":
                request.send_header("Retry-After", self.retry_after)
            if mode == "redirect":
                request.send_header("Location", self.redirect_to)
            request.send_header("Content-Length", "0")
            request.end_headers()
        except OSError:
            # the sender gave up (its timeout) or died
            return
