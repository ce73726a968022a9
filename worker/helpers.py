"""The worker's helper tasks: the one periodic runner the heartbeat and the
draft writer repeat, and the one policy for any helper task that dies.

The policy is crash-only. A helper (the heartbeat, the listener, the draft
writer, the deliverer, the batch lane) that dies of anything but a database
error is reported to the round (``HelperDied``), which raises
``WorkerCrashed``; the process exits non-zero (70, worker/__main__.py) at
once and its supervisor starts a new one. Why not stop gently: a helper
that died is a defect, and the process's state is no longer known; a kill
at any line is the one path every guarantee is built for (a held job stays
``running`` until the sweeper fails it, nobody calls the LLM for it again;
a leased delivery or batch lease runs out and is taken again), and the
SIGKILL tests run it. A gentle stop would be a second path, run only when
something is already broken, and for the heartbeat not even a safe one: a
worker that cannot heartbeat must not hold jobs through a grace period.
Database errors are not deaths: each loop waits them out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog

from shared import db
from worker.inbox import HelperDied, Inbox

log = structlog.get_logger()


class WorkerCrashed(RuntimeError):
    """A helper task died of something other than a database error; it was
    logged where it happened (``worker.task_crashed``)."""


async def every(interval_s: float, once: Callable[[], Awaitable[object]], errors: db.ErrorEpisode, *,
                sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                context: Callable[[], dict[str, Any]] = dict) -> None:
    """Sleeps ``interval_s``, runs ``once``, forever. A database error is one
    episode of ``errors`` (logged with ``context()`` when it starts) and the
    next interval tries again; anything else ends the task."""
    while True:
        await sleep(interval_s)
        try:
            await once()
        except db.DB_ERRORS as exc:
            errors.failed(exc, **context())
            continue
        errors.succeeded()


def start_helper(work: Coroutine[Any, Any, None], name: str, inbox: Inbox) -> asyncio.Task[None]:
    """Runs a helper in a task of its own, reported to the round if it dies
    of an exception (see above); cancelled, or returned once the worker
    stopped it, it did not die."""

    def ended(task: asyncio.Task[None]) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is None:
            return
        log.error("worker.task_crashed", task=name, error=repr(exc),
                  detail="the worker exits for its supervisor to restart it", exc_info=exc)
        inbox.put(HelperDied(name))

    task = asyncio.create_task(work, name=name)
    task.add_done_callback(ended)
    return task
