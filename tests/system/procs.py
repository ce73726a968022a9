"""Start the real entrypoints (``python -m api|worker|sweeper``) as OS
processes against a test database, read their JSON logs, signal them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from tests.support.host import REPO, free_port
from tests.support.waiting import wait_until_sync

__all__ = ["REPO", "ApiProc", "Proc", "System", "free_port", "wait_while_running"]


def wait_while_running(check: Callable[[], bool], procs: Sequence[Proc], *, what: str, timeout: float = 60.0,
                       interval: float = 0.05) -> None:
    """wait_until_sync, failing at once, with its output, if one of ``procs`` exits meanwhile."""

    def done() -> bool:
        for proc in procs:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}) while waiting for {what}:\n"
                                   f"{proc.output()[-3000:]}")
        return check()

    wait_until_sync(done, timeout=timeout, what=what, interval=interval)


class Proc:
    """One running entrypoint (``python -m module [args]``); its stdout and
    stderr (JSON log lines) go to a file."""

    def __init__(self, name: str, module: str, env: dict[str, str], log_path: Path,
                 args: tuple[str, ...] = ()) -> None:
        self.name = name
        self.log_path = log_path
        self._log_file = log_path.open("wb")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=REPO, env=env, stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def events(self) -> list[dict[str, Any]]:
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    found.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return found

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_event(self, event: str, timeout: float = 20.0) -> dict[str, Any]:
        found: list[dict[str, Any]] = []

        def logged() -> bool:
            found.extend(entry for entry in self.events() if entry.get("event") == event)
            return bool(found)

        wait_while_running(logged, [self], what=f"{self.name} to log {event}", timeout=timeout)
        return found[0]

    def signal(self, signum: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def wait(self, timeout: float = 30.0) -> int:
        return self.popen.wait(timeout=timeout)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        self._log_file.close()
        return self.popen.returncode


class ApiProc(Proc):
    def __init__(self, env: dict[str, str], log_path: Path, port: int) -> None:
        super().__init__("api", "api", env, log_path)
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 20.0) -> None:
        wait_while_running(self.ready, [self], what="the api to be ready", timeout=timeout)

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False


TRACE_VARIABLES = ("STORYJOBS_TEST_ID", "STORYJOBS_QUERY_TRACE", "COVERAGE_PROCESS_START")


class System:
    """The processes of one test; every one is stopped when the test ends."""

    def __init__(self, database_url: str, log_dir: Path, **env: str) -> None:
        self.database_url = database_url
        self.log_dir = log_dir
        self.env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": os.environ.get("HOME", "/tmp"),
            "PYTHONPATH": str(REPO),
            "DATABASE_URL": database_url,
            "LOG_FORMAT": "json",
            "LOG_LEVEL": "info",
            "METRICS_PORT": "0",
            # the mutation runs' coverage map follows a test into the
            # processes it starts (tests/mutants/coverage_map.py)
            **{name: value for name, value in os.environ.items() if name in TRACE_VARIABLES},
            **env,
        }
        self.procs: list[Proc] = []
        self._counts: dict[str, int] = {}

    def _log_path(self, name: str) -> Path:
        self._counts[name] = self._counts.get(name, 0) + 1
        return self.log_dir / f"{name}-{self._counts[name]}.log"

    def _env(self, overrides: dict[str, Any]) -> dict[str, str]:
        return {**self.env, **{k: str(v) for k, v in overrides.items()}}

    def api(self, **env: Any) -> ApiProc:
        """An api process; a test that sets QUEUE_MAX tests the whole queue,
        so one client may fill it unless the test sets CLIENT_QUEUE_MAX (the
        default, half, is tested where it is the subject)."""
        if "QUEUE_MAX" in env:
            env.setdefault("CLIENT_QUEUE_MAX", env["QUEUE_MAX"])
        port = free_port()
        proc = ApiProc(self._env({"API_PORT": port, **env}), self._log_path("api"), port)
        self.procs.append(proc)
        proc.wait_ready()
        return proc

    def worker(self, *, wait: bool = True, **env: Any) -> Proc:
        proc = Proc("worker", "worker", self._env(env), self._log_path("worker"))
        self.procs.append(proc)
        if wait:
            proc.wait_for_event("worker.started")
        return proc

    def sweeper(self, *, wait: bool = True, **env: Any) -> Proc:
        proc = Proc("sweeper", "sweeper", self._env(env), self._log_path("sweeper"))
        self.procs.append(proc)
        if wait:
            proc.wait_for_event("sweeper.started")
        return proc

    def start(self, name: str, module: str, *args: str, **env: Any) -> Proc:
        """Any other program run as ``python -m module args``, with this
        system's environment: the benchmarks' peer queues and their tools."""
        proc = Proc(name, module, self._env(env), self._log_path(name), args)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                proc.signal(signal.SIGTERM)
        for proc in self.procs:
            proc.stop(timeout=15)
