"""``python -m worker``: claim and run story jobs, deliver webhooks, and
run the batch lane when this worker holds its lease, until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import structlog
from opentelemetry import trace
from psycopg_pool import AsyncConnectionPool

from shared import db, process, telemetry
from shared.config import WorkerSettings
from shared.ratelimit import RateLimits
from worker.batch.lane import BatchLane
from worker.batch.provider import BatchProvider
from worker.batch.store import BatchStore
from worker.coordinator import STATEMENT_TIMEOUT_S, Coordinator, WorkerCrashed, new_worker_id
from worker.delivery.loop import Deliverer
from worker.delivery.store import PgDeliveryStore
from worker.draft_store import PgDraftStore
from worker.helpers import start_helper
from worker.pg_store import PgWorkerStore
from worker.writing import StoryWriter

log = structlog.get_logger()

# exit codes: 0 everything held was recorded; 1 shutdown left jobs to the
# sweeper; 70 a helper task died (logged where it happened; the policy:
# worker/helpers.py)
EXIT_ABANDONED = 1
EXIT_CRASHED = 70
# the longest a draft write may take: it holds its jobs' rows meanwhile
DRAFT_STATEMENT_TIMEOUT_S = 2.0


def make_batch_provider(settings: WorkerSettings) -> BatchProvider:
    if settings.offline:
        from worker.batch.offline_batches import OfflineBatches

        return OfflineBatches.from_settings(settings)
    from worker.batch.anthropic_batches import AnthropicBatches

    return AnthropicBatches.from_settings(settings)


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
        tracer = trace.get_tracer("storyjobs.worker") if telemetry.tracing_enabled() else None
        batch_provider = make_batch_provider(settings)
        async with (_side_pool(settings, "webhooks") as deliveries_pool,
                    _side_pool(settings, "batches") as batch_pool,
                    _drafts_pool(settings) as drafts_pool):
            drafts = None if drafts_pool is None else PgDraftStore(drafts_pool, worker_id=store.worker_id)
            coordinator = Coordinator(settings, store, writer, listen=settings.worker_listen, tracer=tracer,
                                      drafts=drafts)
            deliverer = Deliverer(settings, PgDeliveryStore(deliveries_pool), tracer=tracer)
            lane = BatchLane(settings, BatchStore(batch_pool), batch_provider, holder=store.worker_id)

            def stop() -> None:
                coordinator.stop()
                deliverer.stop()
                lane.stop()

            process.on_stop_signal(stop)
            # crash-only, as every helper (worker/helpers.py): one that dies crashes the worker
            helpers = [start_helper(deliverer.run(), "deliverer", coordinator.inbox),
                       start_helper(lane.run(), "batch lane", coordinator.inbox)]
            try:
                clean = await coordinator.run()
            except WorkerCrashed:
                for task in helpers:
                    task.cancel()
                return EXIT_CRASHED
            finally:
                deliverer.stop()
                lane.stop()
                ended = await asyncio.gather(*helpers, return_exceptions=True)
                await writer.aclose()
                await batch_provider.aclose()
            if any(isinstance(end, Exception) for end in ended):
                return EXIT_CRASHED  # a helper died while the worker stopped (logged as it died)
    return 0 if clean else EXIT_ABANDONED


@contextlib.asynccontextmanager
async def _drafts_pool(settings: WorkerSettings) -> AsyncIterator[AsyncConnectionPool | None]:
    """The draft writer's connection (none with DRAFT_INTERVAL_S=0): a write
    is cut short at DRAFT_STATEMENT_TIMEOUT_S, so that it never holds its
    jobs' rows (FOR SHARE) long enough to delay their ends."""
    if settings.draft_interval_s <= 0:
        yield None
        return
    async with _side_pool(settings, "drafts", statement_timeout_s=DRAFT_STATEMENT_TIMEOUT_S) as pool:
        yield pool


@contextlib.asynccontextmanager
async def _side_pool(settings: WorkerSettings, name: str,
                     statement_timeout_s: float = 10.0) -> AsyncIterator[AsyncConnectionPool]:
    """A connection of its own for the deliveries, the batch lane or the
    drafts, so that none waits for the job loop's connections (nor it for
    theirs): each of their statements is short, so one connection serves them."""
    pool = db.make_pool(
        db.database_url(settings), application_name=f"storyjobs-worker-{name}",
        connect_timeout_s=settings.db_connect_timeout_s, statement_timeout_s=statement_timeout_s, min_size=1,
        max_size=1, wait_timeout_s=2.0, generic_plans=True, pooler=settings.database_pooler,
    )
    await pool.open(wait=False)
    try:
        yield pool
    finally:
        await pool.close()


def main() -> None:
    process.main(WorkerSettings, process="worker", serve=serve, metrics_port=lambda s: s.metrics_port, traced=True)


if __name__ == "__main__":
    main()
