"""The console's history: minute_rollup, kept by the sweeper at each pass.

Each pass recounts the last few minutes (twice its interval and two minutes
more, so a job committed late, or a pass that came late, still lands in
its minute) from the jobs and the ledger, adds the queue depth it saw to the
current minute, and deletes minutes older than eight days. The console reads
these rows (at most 10,080 for a week), never a week of jobs.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from shared.config import SweeperSettings

# a job claimed or finished in the minutes recounted was created at most
# this long before them (the sweeper fails it otherwise), with a margin for
# a sweeper that runs late and clocks that disagree
_MARGIN = timedelta(minutes=10)


def lookback(settings: SweeperSettings) -> timedelta:
    """How far back each pass recounts."""
    minutes = math.ceil(2 * settings.sweeper_interval_s / 60) + 2
    return timedelta(minutes=min(minutes, 60))


def window(settings: SweeperSettings, now: datetime) -> tuple[datetime, datetime]:
    """The first minute a pass at ``now`` recounts, and the oldest creation
    time of a job that can count in the minutes from it."""
    from_minute = now.replace(second=0, microsecond=0) - lookback(settings)
    oldest = from_minute - timedelta(seconds=settings.pending_timeout_s + settings.job_timeout_s) - _MARGIN
    return from_minute, oldest
