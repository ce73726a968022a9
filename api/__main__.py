"""``python -m api``: serve the api with uvicorn (uvloop, httptools with the
request head bounded: api/server.py).

API_WORKERS > 1 runs that many processes on one port (uvicorn's workers);
their Prometheus metrics are then shared through PROMETHEUS_MULTIPROC_DIR, so
/metrics answers for all of them whichever one serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import structlog
import uvicorn
from litestar import Litestar
from psycopg_pool import AsyncConnectionPool

from api.app import create_app
from api.server import BoundedHttpToolsProtocol
from shared import db, logs, telemetry
from shared.config import ApiSettings
from shared.config_load import load_or_exit
from shared.startup import wait_for_schema

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = structlog.get_logger()


def pool_lifespan(pool: AsyncConnectionPool) -> Callable[[Litestar], contextlib.AbstractAsyncContextManager[None]]:
    """A lifespan that opens ``pool`` when the server starts and closes it
    when the server stops."""

    @contextlib.asynccontextmanager
    async def pool_open(_: Litestar) -> AsyncIterator[None]:
        # not waiting for a first connection: the api starts while the
        # database is away, and /readyz says when it answers
        await pool.open(wait=False)
        try:
            yield
        finally:
            await pool.close()

    return pool_open


def build_app() -> Litestar:
    """The app of one api process, with its own pool, open while the server runs."""
    settings = load_or_exit(ApiSettings)
    logs.configure(settings.log_level, settings.log_format, process="api")
    # each uvicorn worker process builds its app here: a provider of its own
    tracer_provider = telemetry.setup_tracing_or_exit("storyjobs-api")
    pool = db.make_pool(
        db.database_url(settings),
        application_name="storyjobs-api",
        connect_timeout_s=settings.db_connect_timeout_s,
        statement_timeout_s=settings.api_statement_timeout_s,
        min_size=2,
        max_size=settings.api_pool_size,
        wait_timeout_s=settings.api_db_wait_s,
        pooler=settings.database_pooler,
    )
    return create_app(settings, pool, lifespan=[pool_lifespan(pool), traces_flushed(tracer_provider), startup_heap_frozen],
                      tracer_provider=tracer_provider)


@contextlib.asynccontextmanager
async def startup_heap_frozen(_: Litestar) -> AsyncIterator[None]:
    """A lifespan that moves every object the process made to start (its
    modules, routes, schemas and pool) out of the garbage collector's reach.
    A request's short-lived objects that outlive a young collection push
    Python into a full one now and then, which walked all of them: 36-49 ms
    at a time, the clients screen's p99 (docs/performance.md). Frozen, a
    full collection walks only what was made since. What it froze is never
    collected: it lives as long as the process, but for the pool's first
    connections, which it replaces when they age (a few, once)."""
    gc.collect()
    gc.freeze()
    yield


def traces_flushed(provider: TracerProvider | None) -> Callable[[Litestar], contextlib.AbstractAsyncContextManager[None]]:
    """A lifespan that exports the spans still batched when the server stops."""

    @contextlib.asynccontextmanager
    async def flushed(_: Litestar) -> AsyncIterator[None]:
        try:
            yield
        finally:
            telemetry.shutdown_tracing(provider)

    return flushed


def main() -> None:
    settings = load_or_exit(ApiSettings)
    logs.configure(settings.log_level, settings.log_format, process="api")
    url = db.database_url(settings)
    asyncio.run(wait_for_schema(url, settings, process="api"))
    log.info("api.starting", host=settings.api_host, port=settings.api_port, workers=settings.api_workers,
             queue_max=settings.queue_max, client_queue_max=settings.effective_client_queue_max)
    server_options: dict[str, Any] = {
        "host": settings.api_host,
        "port": settings.api_port,
        "loop": "uvloop",
        "http": BoundedHttpToolsProtocol,
        "lifespan": "on",
        "access_log": False,
        "log_level": "warning",
        "server_header": False,
        "timeout_graceful_shutdown": 10,
    }
    if settings.api_workers == 1:
        uvicorn.run(build_app(), **server_options)
        return
    # the worker processes read these from the environment they inherit
    os.environ["DATABASE_URL"] = url
    metrics_dir = tempfile.mkdtemp(prefix="storyjobs-api-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        uvicorn.run("api.__main__:build_app", factory=True, workers=settings.api_workers, **server_options)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
