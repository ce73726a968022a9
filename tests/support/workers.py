"""A worker coordinator on the test's pool, built as ``python -m worker``
builds one, and run in the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from psycopg_pool import AsyncConnectionPool

from shared.config import WorkerSettings
from worker.coordinator import Coordinator, new_worker_id
from worker.draft_store import PgDraftStore
from worker.pg_store import PgWorkerStore
from worker.writing import StoryWriter


def worker_on(
    settings: WorkerSettings, pool: AsyncConnectionPool, writer: StoryWriter, *, listen_url: str | None,
    worker_id: str | None = None, drafts_pool: AsyncConnectionPool | None = None,
) -> Coordinator:
    """A worker coordinator on the test's pool, as python -m worker builds one;
    with ``drafts_pool``, it writes drafts there (every DRAFT_INTERVAL_S)."""
    store = PgWorkerStore(pool, worker_id=worker_id or new_worker_id(), provider=writer.provider,
                          model=writer.model, listen_url=listen_url, connect_timeout_s=5,
                          default_max_tokens=settings.llm_max_tokens)
    drafts = None if drafts_pool is None else PgDraftStore(drafts_pool, worker_id=store.worker_id)
    return Coordinator(settings, store, writer, listen=listen_url is not None, drafts=drafts)


@contextlib.asynccontextmanager


async def running_worker(
    settings: WorkerSettings, pool: AsyncConnectionPool, writer: StoryWriter, *, listen_url: str | None,
    drafts_pool: AsyncConnectionPool | None = None,
) -> AsyncIterator[Coordinator]:
    """A worker coordinator running in this event loop; stopped (gracefully) on exit."""
    worker = worker_on(settings, pool, writer, listen_url=listen_url, drafts_pool=drafts_pool)
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        worker.stop()
        await asyncio.wait_for(task, timeout=30)
