"""The heartbeat: every HEARTBEAT_INTERVAL_S, one statement refreshes every
job this process holds (heartbeat_at and progress, where the job is still
ours). A job it finds no longer ours (swept or cancelled) is reported to the
coordinator, which stops its stream at once; the heartbeat writes nothing of
the coordinator's. Database errors are logged once per episode and beaten
through; anything else ends the task, and the worker with it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from shared import db
from worker.store import WorkerStore


class Holder(Protocol):
    """What the heartbeat needs of the coordinator."""

    def beats(self) -> dict[int, int]:
        """The held jobs, with their progress."""
        ...

    def gone(self, job_id: int, reason: str) -> bool:
        """The job is no longer ours; True when its call was stopped."""
        ...


class Heartbeat:
    def __init__(
        self,
        store: WorkerStore,
        holder: Holder,
        *,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._store = store
        self._holder = holder
        self._interval_s = interval_s
        self._clock = clock
        self._sleep = sleep

    async def once(self) -> list[int]:
        """One beat; the ids of the jobs whose call it had stopped."""
        progress = self._holder.beats()
        if not progress:
            return []
        rows = await self._store.heartbeat(progress)
        return [row.id for row in rows
                if not row.alive and self._holder.gone(row.id, row.error_code or row.status or "gone")]

    async def run(self) -> None:
        errors = db.ErrorEpisode("worker", clock=self._clock, task="heartbeat")
        while True:
            await self._sleep(self._interval_s)
            try:
                await self.once()
            except db.DB_ERRORS as exc:
                errors.failed(exc)
                continue
            errors.succeeded()
