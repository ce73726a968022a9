"""``python -m sweeper``: fail stale jobs, export queue gauges, prune."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import structlog
import uvloop
from prometheus_client import start_http_server

from shared import db, logs
from shared.config import SweeperSettings, load_or_exit
from shared.startup import wait_for_schema
from sweeper.sweep import DB_ERRORS, Sweeper

log = structlog.get_logger()


async def run(sweeper: Sweeper, stop: asyncio.Event) -> None:
    """Sweep at start and every SWEEPER_INTERVAL_S; probe the connection at
    the heartbeat interval in between."""
    settings = sweeper.settings
    probe_every = min(settings.heartbeat_interval_s, settings.sweeper_interval_s)
    next_sweep = 0.0
    while not stop.is_set():
        try:
            if time.monotonic() >= next_sweep:
                await sweeper.sweep_once()
                next_sweep = time.monotonic() + settings.sweeper_interval_s
            else:
                await sweeper.probe()
        except DB_ERRORS as exc:
            log.warning("sweeper.pass_failed", error=str(exc).strip()[:200])
            sweeper.connection_lost()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=min(probe_every, max(next_sweep - time.monotonic(), 0.05)))


async def serve(settings: SweeperSettings) -> None:
    url = db.database_url(settings)
    await wait_for_schema(url, settings, process="sweeper")
    pool = db.make_pool(
        url,
        application_name="storyjobs-sweeper",
        connect_timeout_s=settings.db_connect_timeout_s,
        statement_timeout_s=60.0,
        min_size=1,
        max_size=1,
        wait_timeout_s=2.0,
        generic_plans=True,
    )
    await pool.open(wait=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    log.info("sweeper.started", interval_s=settings.sweeper_interval_s,
             heartbeat_timeout_s=settings.heartbeat_timeout_s, job_timeout_s=settings.job_timeout_s,
             pending_timeout_s=settings.pending_timeout_s)
    try:
        await run(Sweeper(settings, pool), stop)
    finally:
        await pool.close()
    log.info("sweeper.stopped")


def main() -> None:
    settings = load_or_exit(SweeperSettings)
    logs.configure(settings.log_level, settings.log_format, process="sweeper")
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr="0.0.0.0")
    uvloop.run(serve(settings))


if __name__ == "__main__":
    main()
