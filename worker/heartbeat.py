"""The heartbeat: every HEARTBEAT_INTERVAL_S, one statement refreshes every
job this process holds (heartbeat_at and progress, where the job is still
ours). A job it finds no longer ours (swept or cancelled) is reported to the
round, and its stream is stopped at once through the stop signal its
executor owns: nobody pays for text no one will see. It writes nothing the
round holds. Database errors are logged once per episode and beaten
through; anything else ends the task, and the worker with it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from shared import db
from worker.held import HeldJobs
from worker.inbox import Gone, Inbox
from worker.store import WorkerStore


class Heartbeat:
    def __init__(
        self,
        store: WorkerStore,
        held: HeldJobs,
        inbox: Inbox,
        *,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._store = store
        self._held = held
        self._inbox = inbox
        self._interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        # each job's progress as reported to clients: never goes back
        self._progress: dict[int, int] = {}

    async def once(self) -> list[int]:
        """One beat; the ids of the jobs whose call it stopped."""
        tokens = self._held.beats()
        self._progress = {job_id: max(n, self._progress.get(job_id, 0)) for job_id, n in tokens.items()}
        if not self._progress:
            return []
        rows = await self._store.heartbeat(self._progress)
        stopped = []
        for row in rows:
            if row.alive:
                continue
            reason = row.error_code or row.status or "gone"
            self._inbox.put(Gone(row.id, reason))
            if self._held.signal_stop(row.id, reason):
                stopped.append(row.id)
        return stopped

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
