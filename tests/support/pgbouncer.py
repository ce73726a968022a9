"""A real PgBouncer in front of the tests' Postgres, in transaction pooling,
started on a free port of 127.0.0.1 (Debian's package; 1.18 has no support for
prepared statements, as many production poolers still have none).

Every database of the server is reachable through it under its own name (a
``*`` fallback entry), so the per-test databases made from the template need
no configuration. Startup parameters PgBouncer does not track are refused, as
in production: a client that sends ``options`` (``-c statement_timeout=...``)
is turned away with ``unsupported startup parameter: options``. Only
``extra_float_digits``, which some drivers send on their own, is ignored.

PgBouncer refuses to run as root: started by root it runs as the user
``postgres`` (or, for a server on a unix socket, as the owner of the socket's
directory), with its config, auth file, log and pid file in a temporary
directory that user owns.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.support.host import free_port
from tests.support.waiting import wait_until_sync

# where Debian puts it; a non-login PATH may lack /usr/sbin
_DEBIAN_BINARY = "/usr/sbin/pgbouncer"
RUN_AS_WHEN_ROOT = "postgres"


class PgBouncerUnavailable(Exception):
    """This machine cannot run PgBouncer (no binary, or no user to run it as)."""


def binary() -> str | None:
    found = shutil.which("pgbouncer")
    if found:
        return found
    return _DEBIAN_BINARY if os.access(_DEBIAN_BINARY, os.X_OK) else None


def _quote(value: str) -> str:
    """A value for PgBouncer's connection strings and auth file: double quotes doubled."""
    return value.replace('"', '""')


def _user_to_run_as(server_host: str) -> pwd.struct_passwd | None:
    """None to run as ourselves; when we are root, which PgBouncer refuses, the
    user that owns the server's unix socket directory (the embedded Postgres
    keeps its socket in a directory only its own user may enter), else
    ``postgres``."""
    if os.geteuid() != 0:
        return None
    if server_host.startswith("/"):
        owner = Path(server_host).stat().st_uid
        if owner != 0:
            return pwd.getpwuid(owner)
    try:
        return pwd.getpwnam(RUN_AS_WHEN_ROOT)
    except KeyError:
        raise PgBouncerUnavailable(
            f"running as root, which PgBouncer refuses, and no user {RUN_AS_WHEN_ROOT!r} to run it as"
        ) from None


class PgBouncer:
    """One PgBouncer process in transaction pooling; stop() ends it and removes its files."""

    def __init__(self, server_url: str, *, default_pool_size: int = 4, max_client_conn: int = 500) -> None:
        executable = binary()
        if executable is None:
            raise PgBouncerUnavailable("the pgbouncer binary is not installed (Debian package pgbouncer)")
        server = conninfo_to_dict(server_url)
        self.run_as = _user_to_run_as(str(server.get("host") or ""))
        self.user = str(server.get("user") or pwd.getpwuid(os.geteuid()).pw_name)
        self.password = str(server["password"]) if server.get("password") else None
        self.host = "127.0.0.1"
        self.port = free_port()
        self.default_pool_size = default_pool_size
        self.directory = Path(tempfile.mkdtemp(prefix="storyjobs-pgbouncer-"))
        self.log_path = self.directory / "pgbouncer.log"
        config_path = self.directory / "pgbouncer.ini"
        # the server as the tests reach it: a TCP host and port, or a unix socket directory
        target = [f"user={self.user}"]
        if server.get("host"):
            target.append(f"host={server['host']}")
        if server.get("port"):
            target.append(f"port={server['port']}")
        if self.password:
            target.append(f"password={self.password}")
        (self.directory / "userlist.txt").write_text(f'"{_quote(self.user)}" "{_quote(self.password or "")}"\n')
        config_path.write_text("\n".join([
            "[databases]",
            f"* = {' '.join(target)}",
            "",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            # the listener is on loopback only, for the duration of a test
            "auth_type = trust",
            f"auth_file = {self.directory / 'userlist.txt'}",
            f"admin_users = {self.user}",
            "pool_mode = transaction",
            f"default_pool_size = {default_pool_size}",
            "min_pool_size = 0",
            "reserve_pool_size = 0",
            f"max_client_conn = {max_client_conn}",
            # no `options` here: a client must not depend on it
            "ignore_startup_parameters = extra_float_digits",
            f"logfile = {self.log_path}",
            f"pidfile = {self.directory / 'pgbouncer.pid'}",
            "server_login_retry = 1",
            "",
        ]))
        identity: dict[str, Any] = {}
        if self.run_as is not None:
            for path in (self.directory, *self.directory.iterdir()):
                os.chown(path, self.run_as.pw_uid, self.run_as.pw_gid)
            identity = {"user": self.run_as.pw_uid, "group": self.run_as.pw_gid, "extra_groups": []}
        self._process = subprocess.Popen(
            [executable, str(config_path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, **identity,
        )
        try:
            self._wait_listening()
            self._check_reaches(str(server.get("dbname") or self.user))
        except BaseException:
            self.stop()
            raise

    def _wait_listening(self, timeout_s: float = 10.0) -> None:
        def listening() -> bool:
            if self._process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited ({self._process.returncode}):\n{self.log()}")
            with socket.socket() as probe:
                return probe.connect_ex((self.host, self.port)) == 0

        wait_until_sync(listening, timeout=timeout_s, what=f"pgbouncer to listen on {self.host}:{self.port}")

    def _check_reaches(self, dbname: str) -> None:
        """Fails at once, with the log, when the pool cannot log in to the server
        (PgBouncer itself would keep a client waiting for client_login_timeout)."""
        try:
            with psycopg.connect(self.url(dbname), autocommit=True, connect_timeout=10) as conn:
                conn.execute("SELECT 1")
        except psycopg.OperationalError as exc:
            raise RuntimeError(f"pgbouncer cannot reach the server: {exc}\n{self.log()}") from exc

    @property
    def pid(self) -> int:
        """The PgBouncer process's id (to read its CPU time)."""
        return self._process.pid

    def url(self, dbname: str) -> str:
        """A connection string to database ``dbname`` through the pool."""
        return make_conninfo(
            host=self.host, port=self.port, user=self.user, dbname=dbname, password=self.password or None,
        )

    def show(self, what: str) -> list[dict[str, Any]]:
        """The admin console's ``SHOW <what>`` (POOLS, SERVERS, CLIENTS, ...) as rows of column: value."""
        if not what.isalpha():
            raise ValueError(f"not a SHOW command: {what!r}")
        with psycopg.connect(self.url("pgbouncer"), autocommit=True) as conn:
            # the admin console speaks the simple query protocol only
            result = conn.pgconn.exec_(f"SHOW {what.upper()}".encode())
            if result.status != psycopg.pq.ExecStatus.TUPLES_OK:
                raise RuntimeError(f"SHOW {what}: {(result.error_message or b'').decode()}")
            names = [(result.fname(column) or b"").decode() for column in range(result.nfields)]
            return [
                {
                    name: None if (value := result.get_value(row, column)) is None else value.decode()
                    for column, name in enumerate(names)
                }
                for row in range(result.ntuples)
            ]

    def pool(self, dbname: str) -> dict[str, Any]:
        """The SHOW POOLS row of database ``dbname``."""
        (row,) = [row for row in self.show("pools") if row["database"] == dbname]
        return row

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log written)"

    def stop(self) -> None:
        """Ends the process (closing its connections) and removes its directory."""
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)
