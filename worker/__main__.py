"""``python -m worker``: claim and run story jobs, and deliver webhooks,
until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import structlog
from psycopg_pool import AsyncConnectionPool

from shared import db, process
from shared.config import WorkerSettings
from shared.ratelimit import RateLimits
from worker.coordinator import STATEMENT_TIMEOUT_S, Coordinator, WorkerCrashed, new_worker_id
from worker.delivery.loop import Deliverer
from worker.delivery.store import PgDeliveryStore
from worker.store import PgWorkerStore
from worker.writing import StoryWriter

log = structlog.get_logger()

# exit codes: 0 everything held was recorded; 1 shutdown left jobs to the
# sweeper; 70 a helper task died (logged where it happened)
EXIT_ABANDONED = 1
EXIT_CRASHED = 70


def make_writer(settings: WorkerSettings) -> StoryWriter:
    if settings.offline:
        from worker.offline import OfflineWriter

        return OfflineWriter(settings.offline_delay_s)
    from worker.anthropic_writer import AnthropicWriter

    return AnthropicWriter(settings)


async def serve(settings: WorkerSettings) -> int:
    async with process.database_pool(settings, process="worker", statement_timeout_s=STATEMENT_TIMEOUT_S,
                                      max_size=3) as pool:
        writer = make_writer(settings)
        if settings.offline:
            log.warning(
                "worker.offline_writer",
                detail="ANTHROPIC_API_KEY is not set: stories come from the built-in offline writer, "
                "for demos and tests only; no LLM is called",
                delay_s=settings.offline_delay_s,
            )
        store = PgWorkerStore(
            pool, worker_id=new_worker_id(), provider=writer.provider, model=writer.model,
            listen_url=db.session_url(settings) if settings.worker_listen else None,
            connect_timeout_s=settings.db_connect_timeout_s, default_max_tokens=settings.llm_max_tokens,
        )
        await store.ensure_rate_bucket(RateLimits.from_settings(settings))
        coordinator = Coordinator(settings, store, writer, listen=settings.worker_listen)
        async with _deliveries_pool(settings) as deliveries_pool:
            deliverer = Deliverer(settings, PgDeliveryStore(deliveries_pool))

            def stop() -> None:
                coordinator.stop()
                deliverer.stop()

            process.on_stop_signal(stop)
            delivering = asyncio.create_task(deliverer.run())

            def deliverer_ended(task: asyncio.Task[None]) -> None:
                # the deliverer dying of a bug stops the worker too: a helper never dies silently
                if not task.cancelled() and task.exception() is not None:
                    coordinator.stop()

            delivering.add_done_callback(deliverer_ended)
            try:
                clean = await coordinator.run()
            except WorkerCrashed:
                return EXIT_CRASHED
            finally:
                deliverer.stop()
                with contextlib.suppress(Exception):
                    await delivering
                await writer.aclose()
            if delivering.exception() is not None:
                log.error("webhook.deliverer_crashed", exc_info=delivering.exception())
                return EXIT_CRASHED
    return 0 if clean else EXIT_ABANDONED


@contextlib.asynccontextmanager
async def _deliveries_pool(settings: WorkerSettings) -> AsyncIterator[AsyncConnectionPool]:
    """The deliveries' own connection, so that webhooks never wait for the
    job loop's connections (nor it for theirs): each claim and record is one
    short statement, so one connection serves WEBHOOK_CONCURRENCY attempts."""
    pool = db.make_pool(
        db.database_url(settings), application_name="storyjobs-worker-webhooks",
        connect_timeout_s=settings.db_connect_timeout_s, statement_timeout_s=10.0, min_size=1, max_size=1,
        wait_timeout_s=2.0, generic_plans=True, pooler=settings.database_pooler,
    )
    await pool.open(wait=False)
    try:
        yield pool
    finally:
        await pool.close()


def main() -> None:
    process.main(WorkerSettings, process="worker", serve=serve, metrics_port=lambda s: s.metrics_port)


if __name__ == "__main__":
    main()
