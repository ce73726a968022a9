"""The listener: LISTEN on a connection of its own, and a claim at once for
every NOTIFY of a new pending job (and when listening starts, since what was
sent before is lost). A broken connection is reconnected with backoff; the
fallback poll covers the gap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from shared import db
from worker.executor import BACKOFF_FIRST_S, BACKOFF_MAX_S
from worker.store import WorkerStore


async def listen(
    store: WorkerStore,
    notified: Callable[[], None],
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    errors = db.ErrorEpisode("worker", clock=clock, task="listener")
    delay = BACKOFF_FIRST_S
    while True:
        try:
            async for _ in store.notifications():
                errors.succeeded()
                delay = BACKOFF_FIRST_S
                notified()
        except db.DB_ERRORS as exc:
            errors.failed(exc)
        await sleep(delay)
        delay = min(delay * 2, BACKOFF_MAX_S)
