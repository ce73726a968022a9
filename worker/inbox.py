"""What the worker's helper tasks report to the round, and the queue they
report into.

The round (worker/coordinator.py) is the one writer of everything the
coordinator holds. Job tasks (with their outcome), the heartbeat, the
listener, the provider's headers, the stop signal and a helper's death only
put a report here; the round drains the inbox at its start and decides on
the reports alone. A report wakes a round that is waiting.
"""

from __future__ import annotations

import asyncio

import msgspec

from shared.ratelimit import ProviderView
from worker.outcomes import Outcome


class Finished(msgspec.Struct, frozen=True):
    """A job's task ended: how its call ended, all the round needs to know
    what to write for the job."""

    job_id: int
    outcome: Outcome


class Gone(msgspec.Struct, frozen=True):
    """The heartbeat found the job no longer ours (swept or cancelled)."""

    job_id: int
    reason: str


class Heard(msgspec.Struct, frozen=True):
    """An answer's anthropic-ratelimit-* headers, as a job's call read them."""

    view: ProviderView


class Notified(msgspec.Struct, frozen=True):
    """A NOTIFY (or the listener's start): pending jobs may be waiting."""


class StopAsked(msgspec.Struct, frozen=True):
    """SIGTERM: no more claims; what is held finishes within the grace."""


class HelperDied(msgspec.Struct, frozen=True):
    """A helper task died of something other than a database error (logged
    where it happened): the worker crashes (worker/helpers.py)."""

    task: str


Report = Finished | Gone | Heard | Notified | StopAsked | HelperDied


class Inbox:
    """An asyncio.Queue of reports: helpers put, the round drains."""

    __slots__ = ("_queue", "_woken_by")

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Report] = asyncio.Queue()
        # the report that ended a wait, kept for the next drain
        self._woken_by: list[Report] = []

    def put(self, report: Report) -> None:
        self._queue.put_nowait(report)

    def drain(self) -> list[Report]:
        """Every report waiting, oldest first."""
        reports, self._woken_by = self._woken_by, []
        while not self._queue.empty():
            reports.append(self._queue.get_nowait())
        return reports

    async def wait(self, timeout_s: float) -> None:
        """Until a report arrives (kept for the next drain) or timeout_s passed."""
        if self._woken_by or not self._queue.empty():
            return
        try:
            async with asyncio.timeout(timeout_s):
                self._woken_by.append(await self._queue.get())
        except TimeoutError:
            pass
