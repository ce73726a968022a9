"""What a route may take by dependency injection: ``api_state`` (what
create_app put on the app's state) and ``slots`` (the pool's slots under the
request's deadline, for /readyz, which must see the failure to connect to say
why); the console's routes take a ``store`` that checked the operator's key
(api/ops/guard.py). And what every client route uses without one: the
deadline, ConnectionSlots.store(), and the id of a job, story or endpoint read
from a path.

Handlers never hold a connection: they are given a store. A client's route
(api/jobs.py says how) takes none by dependency: it enters ``deadline``, then
takes its store from ``connection_slots.store()``, for as long as it needs
it: POST /stories/generate gives its connection back before its admission
batch takes one of the same pool, and the poll before it reads the drain
statistics. A generator dependency cost the poll, the hottest path, a
measured sixth of its CPU (docs/performance.md).

The deadline: all database work of an answer runs within
API_REQUEST_TIMEOUT_S of taking its connection (waiting for the connection
included). Past it, or with the database unreachable, the answer is 503 with
Retry-After (api.problems), never a hang.

``slots`` (and the console's ``store``) are async generator dependencies:
Litestar takes them before the handler runs, throws whatever the handler
raised into them, and closes them once the handler's answer is built. The
deadline is an ``asyncio.timeout``, which cancels the task that entered it; so
they must be resolved in the request's own task, never beside another
dependency (Litestar resolves dependencies that do not depend on each other
concurrently, in a task group). Each route's dependencies form one chain
(``api_state``, then ``slots`` or ``store``, then ``operator``, which reads
the store), and tests/unit/test_api_dependencies.py checks every route. For
the same reason no dependency resolved after ``store`` queries the database:
a query that outlives the deadline there would be cancelled outside
``store``'s reach.
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
from api.store import ApiStore
from shared.config import ApiSettings
from shared.store import Conn

_NO_SUCH_ID = uuid.UUID(int=0)


class ConnectionSlots:
    """The one way a request takes a pooled connection (``connection()``, for
    the console's ``store`` dependency; ``store()``, for a client's route):
    as many requests at once as the pool has
    connections, the others queued
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

    def store(self) -> _SlotStore:
        """An ApiStore on a connection of the pool, once a slot is free; both
        given back on exit."""
        return _SlotStore(self)

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
        self._pooled: AbstractAsyncContextManager[Conn] | None = None

    async def __aenter__(self) -> Conn:
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


class _SlotStore:
    """ConnectionSlots.store(): the slot's connection, as an ApiStore."""

    __slots__ = ("_connection",)

    def __init__(self, slots: ConnectionSlots) -> None:
        self._connection = _SlotConnection(slots)

    async def __aenter__(self) -> ApiStore:
        return ApiStore(await self._connection.__aenter__())

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._connection.__aexit__(*exc_info)


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
    api_state.connection_slots.store() as store``): an outage or a hung
    network answers TimeoutError (503), never a hang. The two are entered
    side by side rather than wrapped in a context manager of our own: a
    generator context manager around them costs every request about 8 us."""
    return asyncio.timeout(api_state.settings.api_request_timeout_s)


async def provide_slots(api_state: NamedDependency[ApiState]) -> AsyncIterator[ConnectionSlots]:
    """The ``slots`` dependency: the pool's slots under ``deadline``, for a
    handler that must see the failure to take a connection (/readyz)."""
    async with deadline(api_state):
        yield api_state.connection_slots


def parse_public_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        # looked up anyway, so a malformed id is the same 404 as an unknown one
        return _NO_SUCH_ID
