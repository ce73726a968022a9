"""The stories' partitions (migration 029), kept by the sweeper's pass.

Stories are partitioned by ranges of job id, each range about a period of
jobs wide (``period_s``: a thirtieth of the retention, at least an hour), so
that retention drops a period's stories at once and gives its space back.
Each pass:

1. bounds stories_unranged (the table as it was before partitions, now the
   default partition) below the ranges, once: a CHECK added NOT VALID and
   then validated, which reads that table without blocking its reads or
   writes. The bound is a period of ids above the sequence, so the pass adds
   the first range before any story can need it;
2. keeps ranges for ``AHEAD`` periods of ids above the next id, each as wide
   as the ids the last period took. Past the last range is stories_ahead,
   which catches what no range holds (a sweeper stopped for days), so no
   story is ever refused. It is replaced while empty; holding stories, it
   becomes a range of its own (bounded and validated as stories_unranged
   was, then detached and attached again with its range), and ranges follow
   it;
3. drops each range whose every job the prune has deleted, once no job can
   still be admitted there.

The partition count stays near 30 + ``AHEAD``: on Postgres 15 a generic plan
locks every partition a statement may touch. Adding and dropping take the
lock on stories that every statement on it waits behind, for a few
milliseconds; each waits at most ``LOCK_TIMEOUT_S`` for it (then the next
pass tries again), so a long reader never holds the polls behind it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import structlog

from shared.queries import QUERIES as Q
from shared.store import Conn, fetch_one, fetch_scalars, job_id_bounds, within_lock_timeout

log = structlog.get_logger()

# ranges kept above the next id, in periods
AHEAD = 2
# the narrowest range, in ids (a new database's first)
MIN_WIDTH = 1000
# how long an add or a drop waits for the lock on stories
LOCK_TIMEOUT_S = 0.5


class StoryPartitionsState(msgspec.Struct, frozen=True):
    bound: int | None
    bound_valid: bool
    ahead_from_id: int | None
    ahead_bound: int | None
    ahead_bound_valid: bool
    next_id: int


class StoryPartitionsKept(msgspec.Struct, frozen=True):
    added: int
    dropped: int
    # stories_ahead holds stories and could not be made a range yet
    behind: bool


def period_s(retention_s: float) -> float:
    """How much time one range's jobs span."""
    return max(retention_s / 30, 3600.0)


async def keep(conn: Conn, *, retention_s: float, now: datetime | None = None) -> StoryPartitionsKept:
    """One pass's care of the partitions: bound, add ahead, drop the emptied.
    ``now`` replaces this process's clock (tests)."""
    now = now or datetime.now(UTC)
    state = await fetch_one(conn, StoryPartitionsState, "story_partitions_state", {})
    assert state is not None
    width = await _width(conn, state.next_id, now - timedelta(seconds=period_s(retention_s)))
    bound = state.bound
    if bound is None:
        bound = state.next_id + width
        if await _locking(conn, "stories_unranged_bound", {"bound": bound}) != [True]:
            # the lock not had, or another caller bound it first: the next pass goes on
            return StoryPartitionsKept(added=0, dropped=0, behind=False)
    if not state.bound_valid:
        await _validate(conn, "stories_unranged_validate")
        log.info("sweeper.stories_unranged_bounded", below_id=bound)
    added, behind = await _add_ahead(conn, state, bound, width)
    dropped = await _drop_emptied(conn)
    return StoryPartitionsKept(added=added, dropped=dropped, behind=behind)


async def _width(conn: Conn, next_id: int, period_start: datetime) -> int:
    """The ids the last period took (job_id_bounds: a binary search on the primary key)."""
    bounds = await job_id_bounds(conn, created_after=period_start, created_before=None)
    return max(MIN_WIDTH, next_id - bounds.lo_id)


async def _add_ahead(conn: Conn, state: StoryPartitionsState, bound: int, width: int) -> tuple[int, bool]:
    """Ranges up to AHEAD widths above the next id; stories_ahead made a range
    when it holds stories, the ranges above it left to the next pass. (ranges
    added, behind)"""
    if state.ahead_bound is not None:
        # an earlier pass began making stories_ahead a range
        closed = await _close_ahead(conn, state.ahead_bound_valid)
        return int(closed), not closed
    top, added = state.ahead_from_id or bound, 0
    # bounded, so that a wrong width cannot make hundreds of ranges in one pass
    while top < state.next_id + AHEAD * width and added <= AHEAD:
        done = await _locking(conn, "story_partition_add", {"lo": top, "hi": top + width})
        if done is None or done[0] is None:
            # the lock not had, or another caller moved the ranges: the next pass goes on
            break
        if not done[0]:
            hi = state.next_id + width
            log.warning("sweeper.stories_ahead_closing", from_id=top, to_id=hi,
                        detail="the ids outran the ranges: stories_ahead holds stories and becomes a range")
            closed = (await _locking(conn, "stories_ahead_bound", {"hi": hi}) is not None
                      and await _close_ahead(conn, False))
            return added + int(closed), not closed
        top += width
        added += 1
    return added, False


async def _close_ahead(conn: Conn, bound_valid: bool) -> bool:
    """stories_ahead made the range its CHECK names (validated first, which
    reads it without blocking); False when the lock was not had."""
    if not bound_valid:
        await _validate(conn, "stories_ahead_validate")
    return await _locking(conn, "story_partition_close_ahead") is not None


async def _validate(conn: Conn, query: str) -> None:
    """A VALIDATE, without the session's statement timeout: it reads the
    whole table, blocking no read or write, and a timeout would cancel it at
    every pass. (Behind a transaction pooler the client keeps the sweeper's
    60 s: `storyjobs migrate`, on a session, runs the same first pass.)"""
    async with conn.transaction():
        await conn.execute(Q["transaction_statement_timeout_off"])
        await conn.execute(Q[query])


async def _drop_emptied(conn: Conn) -> int:
    dropped = 0
    for name in await fetch_scalars(conn, "story_partitions_droppable"):
        done = await _locking(conn, "story_partition_drop", {"name": name})
        if done is None:
            break
        if done[0]:
            log.info("sweeper.story_partition_dropped", partition=name)
            dropped += 1
    return dropped


async def _locking(conn: Conn, query: str, params: dict[str, Any] | None = None) -> list[Any] | None:
    """One statement that takes the lock on stories, in a transaction that
    waits at most LOCK_TIMEOUT_S for it: its scalars, or None (logged) when
    the lock was not had; the next pass tries again."""
    got = await within_lock_timeout(conn, LOCK_TIMEOUT_S, lambda: fetch_scalars(conn, query, params))
    if got is None:
        log.warning("sweeper.story_partitions_lock_waited", statement=query, lock_timeout_s=LOCK_TIMEOUT_S)
    return got
