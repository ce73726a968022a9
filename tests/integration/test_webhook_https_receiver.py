"""A webhook to an https receiver (worker.delivery.send post): the sender
connects to the address it checked, and still greets the receiver by its
name (TLS SNI) and verifies the certificate against that name, as any https
client would. The receiver is a TLS server on 127.0.0.1 with a certificate
for hooks.example made by the openssl command, and records the name each
connection asked for."""

from __future__ import annotations

import ipaddress
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from shared.webhooks import Address
from worker.delivery import send

NAME = "hooks.example"


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", f"/CN={NAME}", "-addext", f"subjectAltName=DNS:{NAME}"],
                   check=True, capture_output=True)
    return key, cert


@pytest.fixture
def receiver(certificate: tuple[Path, Path]) -> Iterator[tuple[int, list[str | None]]]:
    """An https server answering 204 on a free port; the names its clients asked for."""
    key, cert = certificate
    asked: list[str | None] = []
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)

    def greeted(_sock: ssl.SSLObject, name: str | None, _context: ssl.SSLContext) -> None:
        asked.append(name)

    context.sni_callback = greeted

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], asked
    finally:
        server.shutdown()
        server.server_close()


async def test_an_https_receiver_is_greeted_and_verified_by_its_name(
    receiver: tuple[int, list[str | None]], certificate: tuple[Path, Path],
) -> None:
    port, asked = receiver
    trusted = ssl.create_default_context(cafile=str(certificate[1]))

    async def loopback(host: str, _port: int) -> list[Address]:
        assert host == NAME
        return [ipaddress.IPv4Address("127.0.0.1")]

    answer = await send.post(f"https://{NAME}:{port}/hook", {"content-type": "application/json"}, b"{}",
                             allow_private=True, timeout_s=5.0, ssl_context=trusted, resolver=loopback)
    assert answer.status_code == 204
    assert asked == [NAME]
