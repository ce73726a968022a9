"""The console's history: minute_rollup, kept by the sweeper at each pass.

Each pass recounts the last few minutes (twice its interval and two minutes
more, so a job committed late, or a pass that came late, still lands in
its minute) from the jobs and the ledger, adds the queue depth it saw to the
current minute, and deletes minutes older than eight days. The console reads
these rows (at most 10,080 for a week), never a week of jobs.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from shared import store
from shared.config import SweeperSettings
from shared.rows import ROLLUP_BOUNDS_S

# a job claimed or finished in the minutes recounted was created at most
# this long before them (the sweeper fails it otherwise), with a margin for
# a sweeper that runs late and clocks that disagree
_MARGIN = timedelta(minutes=10)


def lookback(settings: SweeperSettings) -> timedelta:
    """How far back each pass recounts."""
    minutes = math.ceil(2 * settings.sweeper_interval_s / 60) + 2
    return timedelta(minutes=min(minutes, 60))


async def record_minutes(conn: store.Conn, settings: SweeperSettings, *, pending: int, running: int,
                         now: datetime | None = None) -> int:
    """Recounts the last minutes into minute_rollup; the minutes written."""
    now = now or datetime.now(UTC)
    from_minute = now.replace(second=0, microsecond=0) - lookback(settings)
    oldest = from_minute - timedelta(seconds=settings.pending_timeout_s + settings.job_timeout_s) - _MARGIN
    bounds = await store.job_id_bounds(conn, created_after=oldest, created_before=None)
    written = await store.rollup_minutes(conn, from_minute=from_minute, from_id=bounds.lo_id, bounds_s=ROLLUP_BOUNDS_S,
                                         pending=pending, running=running)
    await store.rollup_prune(conn)
    return written
