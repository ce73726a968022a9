"""The console's overview, history and workers (api/ops/overview.py,
api/ops/history.py, api/ops/workers.py, ``storyjobs stats``): the day's
counts, the rate buckets, the rollup in buckets, who wrote lately, the
workers; with the two rules both screens apply (how far back a day's
finished jobs can start, when an old snapshot is worth a warning). One
method per query of sql/console.sql, its name the query's; the common reads
they add (job_id_bounds, budget_days_today, database_snapshot_ages) are in
shared/store.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec

from shared.config import BaseSettings
from shared.console_rows import OpsOverviewRow, RateBucketRow, RollupMinuteRow, WorkerRow
from shared.ratelimit import RateLimits
from shared.rows import SnapshotAges
from shared.store import Conn, fetch_all, fetch_one, fetch_scalars

# a job finishes within PENDING_TIMEOUT_S + JOB_TIMEOUT_S of its creation, or
# the sweeper fails it at its next pass: this much later at worst, unless the
# sweeper is stopped
SWEEPER_LAG = timedelta(minutes=10)


def finished_since(settings: BaseSettings, window: timedelta) -> datetime:
    """The oldest creation time of a job that can have finished in the last
    ``window``: ops_overview's day_from_id is job_id_bounds' lo_id from it."""
    longest_life = timedelta(seconds=settings.pending_timeout_s + settings.job_timeout_s) + SWEEPER_LAG
    return datetime.now(UTC) - window - longest_life


def snapshot_warning(ages: SnapshotAges, warn_after_s: float) -> str | None:
    """The console's line (and `storyjobs stats`'s) when a transaction or a
    snapshot on the jobs' database is older than XMIN_HORIZON_WARN_S."""
    if not ages.known:
        return None
    oldest = max(ages.oldest_transaction_age_s or 0.0, ages.oldest_snapshot_age_s or 0.0)
    if oldest <= warn_after_s:
        return None
    return (f"a transaction or snapshot has been open for {oldest:.0f} s (XMIN_HORIZON_WARN_S {warn_after_s:g}): "
            "VACUUM removes no row changed since, so the live-jobs indexes grow and the claim slows. Find it "
            "with SELECT pid, usename, application_name, xact_start, state, query FROM pg_stat_activity "
            "WHERE backend_xmin IS NOT NULL ORDER BY xact_start, and end it (pg_terminate_backend)")


class ConsoleStats:
    """The overview's, history's and workers' queries, on the console's
    connection (ConsoleStore.stats). Every method may raise any of
    ``shared.db.DB_ERRORS``."""

    __slots__ = ("conn",)

    def __init__(self, conn: Conn) -> None:
        self.conn = conn

    async def ops_overview(self, *, day_from_id: int) -> OpsOverviewRow:
        row = await fetch_one(self.conn, OpsOverviewRow, "ops_overview", {"day_from_id": day_from_id})
        assert row is not None
        return row

    async def llm_rate_bucket_list(self, *, limits: RateLimits) -> list[RateBucketRow]:
        """The buckets, refilled to now at these limits' rates (a kind without one: as stored)."""
        return await fetch_all(self.conn, RateBucketRow, "llm_rate_bucket_list", msgspec.structs.asdict(limits))

    async def ops_history(self, *, since: datetime, step: timedelta, origin: datetime) -> list[RollupMinuteRow]:
        """The rollup from since, summed into buckets of step aligned on
        origin (each row's minute is its bucket's start)."""
        return await fetch_all(self.conn, RollupMinuteRow, "ops_history",
                               {"since": since, "step": step, "origin": origin})

    async def ops_writers_recent(self) -> list[str]:
        return [str(provider) for provider in await fetch_scalars(self.conn, "ops_writers_recent")]

    async def ops_workers(self) -> list[WorkerRow]:
        return await fetch_all(self.conn, WorkerRow, "ops_workers", {})
