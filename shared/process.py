"""What the worker and the sweeper do alike as processes: read their settings
and set up logs, traces and metrics in ``main()``, wait for a migrated database, open
a pool, and turn SIGTERM or SIGINT into a graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, NoReturn, TypeVar

import uvloop
from prometheus_client import start_http_server
from psycopg_pool import AsyncConnectionPool

from shared import db, logs, telemetry
from shared.config import BaseSettings
from shared.config_load import load_or_exit
from shared.startup import wait_for_schema

S = TypeVar("S", bound=BaseSettings)


def main(settings_type: type[S], *, process: str, serve: Callable[[S], Coroutine[Any, Any, int]],
         metrics_port: Callable[[S], int], traced: bool = False) -> NoReturn:
    """A process's ``main()``: settings (a bad one exits with one line),
    logs, traces when ``traced`` and the OTEL_* variables ask for them (as
    service storyjobs-<process>; shared/telemetry.py), the metrics endpoint
    (port 0: none), then ``serve``'s exit code, once the spans still batched
    are exported."""
    settings = load_or_exit(settings_type)
    logs.configure(settings.log_level, settings.log_format, process=process)
    tracing = telemetry.setup_tracing_or_exit(f"storyjobs-{process}") if traced else None
    port = metrics_port(settings)
    if port:
        start_http_server(port, addr="0.0.0.0")
    try:
        code = uvloop.run(serve(settings))
    finally:
        telemetry.shutdown_tracing(tracing)
    sys.exit(code)


@contextlib.asynccontextmanager
async def database_pool(
    settings: BaseSettings, *, process: str, statement_timeout_s: float, max_size: int,
) -> AsyncIterator[AsyncConnectionPool]:
    """Once the database answers with a schema this code can use: a pool,
    opened without waiting (the caller's loop rides out an outage itself),
    closed on exit. Statements are planned once and run on generic plans,
    unless a transaction pooler is in front (DATABASE_POOLER): then each is
    planned when it runs, and the statement timeout is kept by the client."""
    url = db.database_url(settings)
    await wait_for_schema(url, settings, process=process)
    pool = db.make_pool(
        url,
        application_name=f"storyjobs-{process}",
        connect_timeout_s=settings.db_connect_timeout_s,
        statement_timeout_s=statement_timeout_s,
        min_size=1,
        max_size=max_size,
        # short: during an outage the process's loop backs off and retries itself
        wait_timeout_s=2.0,
        generic_plans=True,
        pooler=settings.database_pooler,
    )
    await pool.open(wait=False)
    try:
        yield pool
    finally:
        await pool.close()


def on_stop_signal(stop: Callable[[], None]) -> None:
    """SIGTERM (an orchestrator's stop) and SIGINT (Ctrl-C) call ``stop``."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop)
