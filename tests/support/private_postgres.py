"""A private Postgres for a benchmark or a test that must control the server
itself (statement_cost runs it under callgrind; history wants autovacuum on
and JIT available, as operators run it; a test needs prepared transactions,
off by default): initdb in a temporary folder, a free port, started as the
postgres user when we are root, stopped and removed after."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from tests.support.host import free_port
from tests.support.waiting import wait_until_sync

# Postgres refuses to run as root
_RUN_AS_WHEN_ROOT = "postgres"


@dataclass(frozen=True)
class PrivateServer:
    url: str
    # the server's folder: its data, its log, what a wrapper writes (callgrind's profiles)
    directory: Path


def server_bindirs() -> list[str]:
    """This machine's Postgres server binaries: pg_config's first, then
    Debian's, newest first; only folders that hold postgres and initdb."""
    candidates = []
    if shutil.which("pg_config"):
        found = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=False)
        candidates.append(found.stdout.strip())
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda path: int(path.split("/")[-2]),
                         reverse=True)
    return [bindir for bindir in candidates
            if bindir and all(os.access(Path(bindir, name), os.X_OK) for name in ("postgres", "initdb"))]


@contextmanager
def private_server(bindir: str, *, settings: Mapping[str, str], wrapper: Sequence[str] = (),
                   start_timeout_s: float = 120, what: str = "the private Postgres") -> Iterator[PrivateServer]:
    """Postgres from ``bindir`` with ``settings`` (-c name=value), started
    under ``wrapper`` (a command its path follows) when one is given; answers
    on 127.0.0.1 as postgres, trust."""
    directory = Path(tempfile.mkdtemp(prefix="storyjobs-postgres-"))
    identity: dict[str, Any] = {}
    if os.geteuid() == 0:
        user = pwd.getpwnam(_RUN_AS_WHEN_ROOT)
        os.chown(directory, user.pw_uid, user.pw_gid)
        identity = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    data = directory / "data"
    subprocess.run([f"{bindir}/initdb", "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"],
                   check=True, capture_output=True, **identity)
    port = free_port()
    log = open(directory / "server.log", "wb")  # noqa: SIM115 - closed below, after the server
    server = subprocess.Popen(
        [*(part.format(directory=directory) for part in wrapper),
         f"{bindir}/postgres", "-D", str(data), "-p", str(port), "-k", str(directory),
         *[arg for name, value in {"listen_addresses": "127.0.0.1", **settings}.items()
           for arg in ("-c", f"{name}={value}")]],
        stdout=log, stderr=subprocess.STDOUT, **identity,
    )
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    try:
        def answers() -> bool:
            if server.poll() is not None:
                raise RuntimeError(f"{what} exited; see {directory}/server.log")
            try:
                psycopg.connect(url, connect_timeout=5).close()
            except psycopg.OperationalError:
                return False
            return True

        wait_until_sync(answers, timeout=start_timeout_s, interval=0.3,
                        what=f"{what} to start (see {directory}/server.log)")
        yield PrivateServer(url, directory)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
        shutil.rmtree(directory, ignore_errors=True)
