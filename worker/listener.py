"""The listener: LISTEN on a connection of its own, and a report to the
round, which claims at once, for every NOTIFY of a new pending job (and
when listening starts, since what was sent before is lost). A broken
connection is reconnected with backoff; the fallback poll covers the gap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from shared import db
from worker.backoff import Backoff
from worker.inbox import Inbox, Notified
from worker.store import WorkerStore


async def listen(
    store: WorkerStore,
    inbox: Inbox,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    errors = db.ErrorEpisode("worker", clock=clock, task="listener")
    backoff = Backoff()
    while True:
        try:
            async for _ in store.notifications():
                errors.succeeded()
                backoff.reset()
                inbox.put(Notified())
        except db.DB_ERRORS as exc:
            errors.failed(exc)
        await sleep(backoff.next_s())
