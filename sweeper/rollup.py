"""The console's history: minute_rollup, kept by the sweeper at each pass.

Each pass recounts the minutes since the last pass wrote (the newest
minute in minute_rollup), and at least the last few minutes (twice its
interval and two minutes more, so a job committed late, or a pass that came
late, still lands in its minute), from the jobs and the ledger; adds the
queue depth it saw to the current minute; and deletes minutes older than
eight days. What a pass reads is therefore bounded by the time since the
last pass, not by the history: after a sweeper outage the first pass fills
the minutes it missed (at most the eight days kept), instead of leaving
them empty. The console reads these rows (at most 10,080 for a week), never
a week of jobs.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from shared.config import SweeperSettings
from shared.rows import ROLLUP_KEPT_S

# a job claimed or finished in the minutes recounted was created at most
# this long before them (the sweeper fails it otherwise), with a margin for
# a sweeper that runs late and clocks that disagree
_MARGIN = timedelta(minutes=10)


def lookback(settings: SweeperSettings) -> timedelta:
    """How far back each pass recounts."""
    minutes = math.ceil(2 * settings.sweeper_interval_s / 60) + 2
    return timedelta(minutes=min(minutes, 60))


# the rollup keeps this much (rollup_prune); a pass never recounts further back
KEPT = timedelta(seconds=ROLLUP_KEPT_S)


def window(settings: SweeperSettings, now: datetime,
           last_written: datetime | None = None) -> tuple[datetime, datetime]:
    """The first minute a pass at ``now`` recounts (the last pass's newest
    minute, if that is older than the late-commit window, but never beyond
    what the rollup keeps), and the oldest creation time of a job that can
    count in the minutes from it."""
    current = now.replace(second=0, microsecond=0)
    from_minute = current - lookback(settings)
    if last_written is not None:
        from_minute = max(min(from_minute, last_written), current - KEPT)
    oldest = from_minute - timedelta(seconds=settings.pending_timeout_s + settings.job_timeout_s) - _MARGIN
    return from_minute, oldest
