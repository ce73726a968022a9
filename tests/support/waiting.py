"""How a test waits for a condition it cannot force: ``wait_until`` (async)
and ``wait_until_sync``, on one deadline."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Iterator


def _tries(timeout: float, what: str) -> Iterator[None]:
    """The one deadline of wait_until and wait_until_sync: a try each time
    round, then TimeoutError naming ``what`` once ``timeout`` seconds are past."""
    deadline = time.monotonic() + timeout
    while True:
        yield
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")


async def wait_until(
    check: Callable[[], bool | Awaitable[bool]], *, timeout: float = 10.0, what: str = "condition",
    interval: float = 0.02,
) -> None:
    """Returns once check() (a plain or an async function) is true; raises
    TimeoutError naming ``what`` after ``timeout`` seconds."""
    for _ in _tries(timeout, what):
        answer = check()
        if inspect.isawaitable(answer):
            answer = await answer
        if answer:
            return
        await asyncio.sleep(interval)


def wait_until_sync(
    check: Callable[[], bool], *, timeout: float = 10.0, what: str = "condition", interval: float = 0.02,
) -> None:
    """wait_until for code that is not async: fixtures and process helpers,
    which async tests call too (it blocks their loop while it waits)."""
    for _ in _tries(timeout, what):
        if check():
            return
        time.sleep(interval)
