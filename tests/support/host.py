"""This machine as the tests see it: the repository's path, a free port."""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Ports handed to servers the tests start. Port 0's answer comes from the
# kernel's ephemeral range, which every outgoing connection on the machine
# also draws from: between the probe and the server's bind, another xdist
# worker's connection to Postgres could take it. Below that range the kernel
# never assigns a port by itself, and each xdist worker takes its own block,
# so a port found free stays free until the server that was given it binds.
_FIRST_PORT = 20_000
_BLOCK = 600


def _worker_index() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker.removeprefix("gw") or 0) % 20


_first = _FIRST_PORT + _worker_index() * _BLOCK
_candidates = itertools.cycle(range(_first, _first + _BLOCK))


def free_port() -> int:
    for _ in range(_BLOCK):
        port = next(_candidates)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in this test process's block of {_BLOCK}")
