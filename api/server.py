"""The HTTP/1.1 protocol the api serves with: uvicorn's httptools protocol,
with the request head (request line and headers) bounded.

httptools itself sets no limit: it would buffer a header of any size, and
uvicorn any number of headers. Here a request whose head passes
MAX_REQUEST_HEAD_BYTES is answered 431 and its connection closed, before the
app sees it; bytes still arriving without the end of a head are cut off at
MAX_UNPARSED_HEAD_BYTES whatever the parser has buffered. Requests that do
not parse at all get uvicorn's 400, as problem+json like every other error.
"""

from __future__ import annotations

from typing import Any

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api.problems import PROBLEM_JSON, Problem

MAX_REQUEST_HEAD_BYTES = 16 * 1024
# raw bytes received while a head is still incomplete: the parser may hold a
# header it has not handed over yet, so this guard counts bytes on the wire
MAX_UNPARSED_HEAD_BYTES = 4 * MAX_REQUEST_HEAD_BYTES

_REASONS = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}


class HeadTooLarge(Exception):
    """Raised from a parser callback: the request head is over its bound."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._unparsed_head_bytes = 0
        self._head_too_large = False

    # -- counting ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        self._unparsed_head_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        # ": " and CRLF as on the wire
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._unparsed_head_bytes = 0
        super().on_headers_complete()

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_REQUEST_HEAD_BYTES:
            self._head_too_large = True
            # the parser turns this into an HttpParserError, which uvicorn
            # answers with send_400_response (below)
            raise HeadTooLarge

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._in_head or self._head_too_large or self.transport.is_closing():
            return
        # the chunk did not finish the head: count it as head (at most one
        # chunk too many, when it also carried the end of the previous request)
        self._unparsed_head_bytes += len(data)
        if self._unparsed_head_bytes > MAX_UNPARSED_HEAD_BYTES:
            self._head_too_large = True
            self.send_400_response("request head too large")

    # -- answering ---------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:
            self._send_problem(431, "Request Header Fields Too Large",
                               f"the request line and headers may take at most {MAX_REQUEST_HEAD_BYTES} bytes")
        else:
            self._send_problem(400, "Bad Request", "the request is not valid HTTP/1.1")

    def _send_problem(self, status: int, title: str, detail: str) -> None:
        body = msgspec.json.encode(Problem(title=title, status=status, detail=detail))
        head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [
            b"content-type: " + PROBLEM_JSON.encode() + b"\r\n",
            b"content-length: %d\r\n" % len(body),
            b"cache-control: no-store\r\n",
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.transport.close()
