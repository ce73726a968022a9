"""The heartbeat: every HEARTBEAT_INTERVAL_S, one statement refreshes every
job this process holds (heartbeat_at and progress, where the job is still
ours). A job it finds no longer ours (swept or cancelled) is reported to the
round (``Gone``), which the report wakes and which stops the job's stream at
once: nobody pays for text no one will see. It only reports: it changes
nothing the round holds, not even a stop signal. It runs on the worker's one
periodic runner (worker/helpers.py): database errors are logged once per
episode and beaten through; anything else ends the task, and the worker
with it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from shared import db
from worker.held import HeldJobs
from worker.helpers import every
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
        """One beat; the ids of the jobs it reported no longer ours."""
        tokens = self._held.beats()
        self._progress = {job_id: max(n, self._progress.get(job_id, 0)) for job_id, n in tokens.items()}
        if not self._progress:
            return []
        rows = await self._store.heartbeat(self._progress)
        gone = [row for row in rows if not row.alive]
        for row in gone:
            self._inbox.put(Gone(row.id, row.error_code or row.status or "gone"))
        return [row.id for row in gone]

    async def run(self) -> None:
        await every(self._interval_s, self.once, db.ErrorEpisode("worker", clock=self._clock, task="heartbeat"),
                    sleep=self._sleep)
