"""``python -m worker``: claim and run story jobs until SIGTERM."""

from __future__ import annotations

import structlog

from shared import db, process
from shared.config import WorkerSettings
from shared.ratelimit import RateLimits
from worker.coordinator import STATEMENT_TIMEOUT_S, Coordinator, WorkerCrashed, new_worker_id
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
            connect_timeout_s=settings.db_connect_timeout_s,
            limits=RateLimits.from_settings(settings), default_max_tokens=settings.llm_max_tokens,
        )
        await store.ensure_rate_bucket()
        coordinator = Coordinator(settings, store, writer, listen=settings.worker_listen)
        process.on_stop_signal(coordinator.stop)
        try:
            clean = await coordinator.run()
        except WorkerCrashed:
            return EXIT_CRASHED
        finally:
            await writer.aclose()
    return 0 if clean else EXIT_ABANDONED


def main() -> None:
    process.main(WorkerSettings, process="worker", serve=serve, metrics_port=lambda s: s.metrics_port)


if __name__ == "__main__":
    main()
