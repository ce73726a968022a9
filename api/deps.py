"""What every route may take by dependency injection: ``api_state`` (what
create_app put on the app's state) and ``conn``, a pooled connection under the
request's deadline; and the id of a job, story or endpoint read from a path.
The poll (api.jobs.get_job), the hottest path, takes its connection itself
rather than take ``conn``: the dependency cost 40 of a poll's 300 us of CPU.

The deadline: all database work of an answer runs within
API_REQUEST_TIMEOUT_S of taking its connection (waiting for the connection
included). Past it, or with the database unreachable, the answer is 503 with
Retry-After (api.problems), never a hang.

``conn`` is an async generator dependency: Litestar takes the connection before
the handler runs, throws whatever the handler raised into it, and gives it
back to the pool once the handler's answer is built. The deadline is an
``asyncio.timeout``, which cancels the task that entered it; so ``conn`` must
be resolved in the request's own task, never beside another dependency
(Litestar resolves dependencies that do not depend on each other concurrently,
in a task group). It takes the request's key for that reason (see
provide_connection), and tests/unit/test_api_dependencies.py checks every
route. For the same reason no dependency resolved after ``conn`` queries the
database: a query that outlives the deadline there would be cancelled outside
``conn``'s reach.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from litestar.datastructures import State
from litestar.di import NamedDependency
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from api import pacing
from api.admission import AdmissionBatcher
from shared import store
from shared.config import ApiSettings

_NO_SUCH_ID = uuid.UUID(int=0)


class ConnectionSlots:
    """The one way a handler takes a pooled connection (``connection()``):
    as many requests at once as the pool has connections, the others queued
    here, at most API_DB_WAIT_S, as they would be in the pool (then
    PoolTimeout: 503). Entered after ``deadline``.

    Why: psycopg_pool queues a request that finds no connection free with
    ``asyncio.wait_for``, a task of its own for every wait (Python 3.11), and
    under load every poll waits. Queued here, a wait costs a future, and a
    timer only while the slots are all taken: at 32 connections the poll
    served about a sixth more (docs/performance.md)."""

    __slots__ = ("_pool", "_semaphore", "_wait_s")

    def __init__(self, pool: AsyncConnectionPool, wait_s: float) -> None:
        self._pool = pool
        self._semaphore = asyncio.Semaphore(pool.max_size)
        self._wait_s = wait_s

    def connection(self) -> _SlotConnection:
        """A connection of the pool, once a slot is free; both given back on exit."""
        return _SlotConnection(self)

    async def _take(self) -> None:
        if not self._semaphore.locked():
            await self._semaphore.acquire()
            return
        try:
            async with asyncio.timeout(self._wait_s):
                await self._semaphore.acquire()
        except TimeoutError:
            raise PoolTimeout(f"no connection was free within {self._wait_s:g} s") from None


class _SlotConnection:
    """ConnectionSlots.connection(): a class rather than a generator context
    manager, which would cost every request about 8 us."""

    __slots__ = ("_pooled", "_slots")

    def __init__(self, slots: ConnectionSlots) -> None:
        self._slots = slots
        self._pooled: AbstractAsyncContextManager[store.Conn] | None = None

    async def __aenter__(self) -> store.Conn:
        await self._slots._take()
        try:
            self._pooled = self._slots._pool.connection()
            return await self._pooled.__aenter__()
        except BaseException:
            self._slots._semaphore.release()
            raise

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._pooled is not None
        try:
            return await self._pooled.__aexit__(*exc_info)
        finally:
            self._slots._semaphore.release()


@dataclass(frozen=True)
class ApiState:
    settings: ApiSettings
    pool: AsyncConnectionPool
    drain_stats: pacing.DrainStatsCache
    admissions: AdmissionBatcher
    connection_slots: ConnectionSlots


def provide_api_state(state: State) -> ApiState:
    """The ``api_state`` dependency: what create_app put on the app's state."""
    api_state: ApiState = state.storyjobs
    return api_state


def deadline(api_state: ApiState) -> asyncio.Timeout:
    """The deadline on all database work of an answer, entered before its
    connection is taken (``async with deadline(api_state),
    api_state.connection_slots.connection() as conn``): an outage or a hung
    network answers TimeoutError (503), never a hang. The two are entered
    side by side rather than wrapped in a context manager of our own: a
    generator context manager around them costs every request about 8 us."""
    return asyncio.timeout(api_state.settings.api_request_timeout_s)


async def provide_connection(
    api_state: NamedDependency[ApiState], api_key: NamedDependency[Any]
) -> AsyncIterator[store.Conn]:
    """The ``conn`` dependency: a connection under ``deadline``, held until the
    handler's answer is built. It takes ``api_key`` (the request's bearer
    key, a client's or an operator's) only so that Litestar resolves the two
    one after the other, and ``conn`` in the request's own task."""
    async with deadline(api_state), api_state.connection_slots.connection() as conn:
        yield conn


def parse_public_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        # looked up anyway, so a malformed id is the same 404 as an unknown one
        return _NO_SUCH_ID
