"""How long a job has left, and so how soon a client should poll again.

Estimates come from the pace of the last finished jobs (job_drain_stats),
read at most every few seconds per api process: a cache, not state.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from datetime import datetime, timedelta

import msgspec
import structlog
from psycopg_pool import AsyncConnectionPool

from api.rows import DrainStats
from api.store import ApiStore
from shared import db
from shared.config import BaseSettings
from shared.status import JobStatus, Lane

# a message batch ends, at the latest, this long after it was created
BATCH_LIFETIME = timedelta(hours=24)

log = structlog.get_logger()

DEFAULT_RETRY_AFTER_S = 2
# what a refresh of the estimates may meet: the database, or its own deadline
_ESTIMATE_ERRORS: tuple[type[Exception], ...] = (*db.DB_ERRORS, TimeoutError)


class DrainStatsCache:
    """The last drain statistics read, refreshed by one request at a time
    (the others answer with what is cached meanwhile). A failed refresh keeps
    the old statistics, or none: an estimate is never worth an error."""

    def __init__(
        self,
        pool: AsyncConnectionPool,
        *,
        model: str = "",
        max_age_s: float = 5.0,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._model = model
        self._max_age_s = max_age_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._stats: DrainStats | None = None
        self._read_at = -math.inf
        self._lock = asyncio.Lock()

    async def get(self) -> DrainStats | None:
        """The statistics, read again when older than max_age_s, on a
        connection of the pool's own. Callers hold none meanwhile (the poll
        gives its back first): a second connection taken while holding one
        could wait on a pool the caller helps fill."""
        if self._clock() - self._read_at < self._max_age_s or self._lock.locked():
            return self._aged()
        async with self._lock:
            if self._clock() - self._read_at >= self._max_age_s:
                try:
                    async with asyncio.timeout(self._timeout_s), self._pool.connection() as conn:
                        self._stats = await ApiStore(conn).job_drain_stats(model=self._model)
                except _ESTIMATE_ERRORS as exc:
                    log.warning("api.drain_stats_unavailable", error=type(exc).__name__)
                # after a failure too: the next try comes max_age_s later
                self._read_at = self._clock()
        return self._aged()

    def _aged(self) -> DrainStats | None:
        """The statistics as they stand now: the running jobs have run for as
        long as the cache has held them."""
        if self._stats is None or not self._stats.running:
            return self._stats
        age = max(self._clock() - self._read_at, 0.0)
        return msgspec.structs.replace(self._stats, longest_running_s=self._stats.longest_running_s + age)


# A story of "about N words" uses about half of the output tokens its length
# allows (prompt.LENGTH_TOKENS): what a running job's percentage is measured
# against. A longer story than expected stays just short of 100 % until done.
EXPECTED_SHARE_OF_MAX_TOKENS = 0.55
_PERCENT_RUNNING_MAX = 99
# below this share written, elapsed time says too little about what is left
_DONE_ENOUGH_TO_EXTRAPOLATE = 0.1


def fraction_done(progress: int | None, max_tokens: int | None) -> float | None:
    """How much of a running job's story is written (0-0.99), or None when its
    length is unknown. It only grows with progress."""
    if not max_tokens:
        return None
    expected = max_tokens * EXPECTED_SHARE_OF_MAX_TOKENS
    return min((progress or 0) / expected, _PERCENT_RUNNING_MAX / 100)


def percent_done(status: JobStatus, fraction: float | None) -> int | None:
    """The job's progress as a whole percentage a bar can show."""
    if status is JobStatus.PENDING:
        return 0
    if status is JobStatus.COMPLETED:
        return 100
    if status is JobStatus.RUNNING and fraction is not None:
        return math.floor(fraction * 100 + 1e-9)
    return None


def seconds_remaining(
    stats: DrainStats | None,
    *,
    status: JobStatus,
    queue_position: int | None,
    started_at: datetime | None,
    now: datetime,
    fraction: float | None = None,
    requests_per_s: float | None = None,
) -> float | None:
    """What is left of a job: for a running job, its own pace over the part
    already written (the same fraction its percentage shows), else the pace of
    recent jobs; a pending job also waits out the rate limiter: its pause,
    and its rate (LLM_REQUESTS_PER_MINUTE) for the jobs ahead."""
    if status is JobStatus.RUNNING and started_at is not None:
        elapsed = max((now - started_at).total_seconds(), 0.0)
        if fraction is not None and fraction >= _DONE_ENOUGH_TO_EXTRAPOLATE and elapsed > 0:
            return elapsed * (1 - fraction) / fraction
    if stats is None or not stats.avg_run_seconds:
        return None
    run = stats.avg_run_seconds
    if status is JobStatus.PENDING and queue_position is not None:
        # the jobs ahead drain through the slots now running, then ours runs
        slots = max(stats.running, 1)
        by_pace = run * (1 + (queue_position - 1) / slots) + run / 2 * min(1, stats.running)
        by_limit = stats.limiter_paused_s + (queue_position / requests_per_s if requests_per_s else 0.0) + run
        return max(by_pace, by_limit)
    if status is JobStatus.RUNNING and started_at is not None:
        elapsed = max((now - started_at).total_seconds(), 0.0)
        return max(run - elapsed, run * 0.1)
    return None


def batch_due_by(settings: BaseSettings, *, ready_at: datetime) -> datetime:
    """When a batch job waiting for a batch since ``ready_at`` is due at the
    latest: the collection's end, then a batch's whole lifetime."""
    return ready_at + timedelta(seconds=settings.batch_collect_s) + BATCH_LIFETIME


def retry_after_for(lane: Lane, settings: BaseSettings, seconds: int) -> int:
    """Retry-After for a job of ``lane``: a batch job is looked at no more
    often than its batches are (BATCH_POLL_INTERVAL_S)."""
    if lane is Lane.BATCH:
        return max(seconds, math.ceil(settings.batch_poll_interval_s))
    return seconds


def retry_after(status: JobStatus, remaining_s: float | None) -> int:
    """Seconds until the next poll is worth it: a fraction of what is left."""
    if remaining_s is None:
        return DEFAULT_RETRY_AFTER_S
    ceiling = 15 if status is JobStatus.PENDING else 10
    return int(min(max(remaining_s / 5, 1), ceiling))


# a full queue with nothing to measure yet: soon, the clients add jitter
QUEUE_FULL_DEFAULT_S = 5
QUEUE_FULL_MAX_S = 60


def queue_full_retry_after(stats: DrainStats | None) -> int:
    """After a 429: about how long until the queue takes its next job, from
    how fast it drains. Once a job has finished, the running job started
    first should end an average run after it started (if it is overdue, one
    slot's share of a run); before that, the last minute's claim rate;
    with nothing measured, soon."""
    if stats is None:
        return QUEUE_FULL_DEFAULT_S
    if stats.avg_run_seconds and stats.running:
        left = stats.avg_run_seconds - stats.longest_running_s
        seconds = left if left > 0 else stats.avg_run_seconds / stats.running
    elif stats.claimed_last_minute >= 2:
        # one claim is an event, not a rate
        seconds = 60 / stats.claimed_last_minute
    else:
        return QUEUE_FULL_DEFAULT_S
    return int(min(max(math.ceil(seconds), 1), QUEUE_FULL_MAX_S))
