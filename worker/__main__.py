"""``python -m worker``: claim and run story jobs until SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys

import structlog
import uvloop
from prometheus_client import start_http_server

from shared import db, logs
from shared.config import WorkerSettings, load_or_exit
from shared.startup import wait_for_schema
from worker.runner import Worker
from worker.writing import StoryWriter

log = structlog.get_logger()


def make_writer(settings: WorkerSettings) -> StoryWriter:
    if settings.offline:
        from worker.offline import OfflineWriter

        return OfflineWriter(settings.offline_delay_s)
    from worker.anthropic_writer import AnthropicWriter

    return AnthropicWriter(settings)


async def serve(settings: WorkerSettings) -> int:
    url = db.database_url(settings)
    await wait_for_schema(url, settings, process="worker")
    writer = make_writer(settings)
    if settings.offline:
        log.warning(
            "worker.offline_writer",
            detail="ANTHROPIC_API_KEY is not set: stories come from the built-in offline writer, "
            "for demos and tests only; no LLM is called",
            delay_s=settings.offline_delay_s,
        )
    pool = db.make_pool(
        url,
        application_name="storyjobs-worker",
        connect_timeout_s=settings.db_connect_timeout_s,
        statement_timeout_s=30.0,
        min_size=1,
        max_size=3,
        # short: during an outage the runner backs off and retries itself
        wait_timeout_s=2.0,
        generic_plans=True,
    )
    await pool.open(wait=False)
    worker = Worker(settings, pool, writer, listen_url=url)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, worker.stop)
    try:
        clean = await worker.run()
    finally:
        await writer.aclose()
        await pool.close()
    return 0 if clean else 1


def main() -> None:
    settings = load_or_exit(WorkerSettings)
    logs.configure(settings.log_level, settings.log_format, process="worker")
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr="0.0.0.0")
    sys.exit(uvloop.run(serve(settings)))


if __name__ == "__main__":
    main()
