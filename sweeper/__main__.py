"""``python -m sweeper``: fail stale jobs, export queue gauges, prune."""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from shared import db, process
from shared.config import SweeperSettings
from sweeper.store import PgSweeperStore
from sweeper.sweep import Sweeper

log = structlog.get_logger()


async def run(sweeper: Sweeper, stop: asyncio.Event) -> None:
    """Sweep at start and every SWEEPER_INTERVAL_S; in between, at the
    heartbeat interval, probe and raise the claim's floor. A failed pass or
    probe of any kind is an outage: it is logged once, running jobs are not
    judged until the database has been writable for a heartbeat timeout, and
    the next try comes a probe interval later. The floor's advance not
    getting the admission lock in time is not a failure (Sweeper.advance_claim_floor)."""
    settings = sweeper.settings
    probe_every = min(settings.heartbeat_interval_s, settings.sweeper_interval_s)
    errors = db.ErrorEpisode("sweeper", clock=time.monotonic)
    next_sweep = 0.0
    while not stop.is_set():
        wait_s = probe_every
        try:
            if time.monotonic() >= next_sweep:
                await sweeper.sweep_once()
                next_sweep = time.monotonic() + settings.sweeper_interval_s
            else:
                await sweeper.probe()
                # while a snapshot is held open, every claim walks the jobs
                # claimed since the floor last rose: raise it more often
                # than a pass comes
                await sweeper.advance_claim_floor()
            wait_s = min(probe_every, max(next_sweep - time.monotonic(), 0.05))
        except db.DB_ERRORS as exc:
            errors.failed(exc, detail="running jobs are not judged until the database has been writable "
                                      "for a heartbeat timeout")
            sweeper.connection_lost()
        else:
            errors.succeeded()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=wait_s)


async def serve(settings: SweeperSettings) -> int:
    async with process.database_pool(settings, process="sweeper", statement_timeout_s=60.0, max_size=1) as pool:
        stop = asyncio.Event()
        process.on_stop_signal(stop.set)
        log.info("sweeper.started", interval_s=settings.sweeper_interval_s,
                 heartbeat_timeout_s=settings.heartbeat_timeout_s, job_timeout_s=settings.job_timeout_s,
                 pending_timeout_s=settings.pending_timeout_s)
        await run(Sweeper(settings, PgSweeperStore(pool)), stop)
    log.info("sweeper.stopped")
    return 0


def main() -> None:
    process.main(SweeperSettings, process="sweeper", serve=serve, metrics_port=lambda s: s.metrics_port,
                 traced=True)


if __name__ == "__main__":
    main()
