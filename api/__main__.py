"""``python -m api``: serve the api with uvicorn (uvloop, httptools with the
request head bounded: api/server.py)."""

from __future__ import annotations

import asyncio

import structlog
import uvicorn

from api.app import create_app
from api.server import BoundedHttpToolsProtocol
from shared import db, logs
from shared.config import ApiSettings, load_or_exit
from shared.startup import wait_for_schema

log = structlog.get_logger()


def main() -> None:
    settings = load_or_exit(ApiSettings)
    logs.configure(settings.log_level, settings.log_format, process="api")
    url = db.database_url(settings)
    asyncio.run(wait_for_schema(url, settings, process="api"))
    pool = db.make_pool(
        url,
        application_name="storyjobs-api",
        connect_timeout_s=settings.db_connect_timeout_s,
        statement_timeout_s=settings.api_statement_timeout_s,
        min_size=2,
        max_size=settings.api_pool_size,
        wait_timeout_s=settings.api_db_wait_s,
    )

    async def open_pool() -> None:
        await pool.open(wait=False)

    async def close_pool() -> None:
        await pool.close()

    app = create_app(settings, pool, on_startup=[open_pool], on_shutdown=[close_pool])
    log.info("api.starting", host=settings.api_host, port=settings.api_port,
             queue_max=settings.queue_max, client_queue_max=settings.effective_client_queue_max)
    uvicorn.run(
        app,
        host=settings.api_host,
        port=settings.api_port,
        loop="uvloop",
        http=BoundedHttpToolsProtocol,
        lifespan="on",
        access_log=False,
        log_level="warning",
        server_header=False,
        timeout_graceful_shutdown=10,
    )


if __name__ == "__main__":
    main()
