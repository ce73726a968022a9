"""What the api's HTTP server refuses before the app sees it: request heads
over their bound (431) and bytes that are not HTTP (400), as problem details,
with the connection closed and the server still serving."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from api.server import MAX_REQUEST_HEAD_BYTES
from tests.support.database import create_key_sync
from tests.system.procs import ApiProc, System

pytestmark = pytest.mark.system


def _exchange(api: ApiProc, *chunks: bytes) -> bytes:
    """Sends raw bytes (stopping early if the server closes) and returns everything the server answers."""
    with socket.create_connection(("127.0.0.1", api.port), timeout=10) as sock:
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        # until the server closes the connection; each read waits at most the socket's 10 s
        received = b""
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                return received
            if not data:
                return received
            received += data


def _status_and_problem(raw: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in header_lines)
    assert headers["content-type"] == "application/problem+json" and headers["connection"] == "close"
    return int(status_line.split()[1]), json.loads(body)


def test_oversized_heads_are_431_and_garbage_is_400(system: System, database_url: str) -> None:
    """A header, many headers, a URL or an endless header stream past the bound are 431; bytes that are not
    HTTP are 400; each closes its connection and the server goes on answering normal requests."""
    key = create_key_sync(database_url, "limits")
    api = system.api()
    request_line = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
    over = MAX_REQUEST_HEAD_BYTES + 1
    cases = {
        "one big header": [request_line + b"X-Big: " + b"a" * over + b"\r\n\r\n"],
        "many headers": [request_line + b"".join(b"X-H%d: %s\r\n" % (n, b"b" * 100) for n in range(200)) + b"\r\n"],
        "long url": [b"GET /stories/jobs/" + b"c" * over + b" HTTP/1.1\r\nHost: x\r\n\r\n"],
        "endless header": [request_line + b"X-Endless: "] + [b"d" * 8192] * 64,
    }
    for name, chunks in cases.items():
        status, problem = _status_and_problem(_exchange(api, *chunks))
        assert status == 431 and problem["status"] == 431, name
    status, problem = _status_and_problem(_exchange(api, b"HELLO THERE\r\n\r\n"))
    assert status == 400 and problem["status"] == 400

    with httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {key}"}) as client:
        just_under = client.get("/healthz", headers={"X-Padding": "e" * (MAX_REQUEST_HEAD_BYTES - 1024)})
        assert just_under.status_code == 200
        too_large = client.post("/stories/generate", json={"prompt": "f" * 40_000}, headers={"Idempotency-Key": "k"})
        assert too_large.status_code == 413
        assert too_large.headers["content-type"] == "application/problem+json"
        accepted = client.post("/stories/generate", json={"prompt": "a fox"}, headers={"Idempotency-Key": "k"})
        assert accepted.status_code == 202
    assert api.popen.poll() is None
