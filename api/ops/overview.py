"""GET /ops/api/overview: the queue now (the batch lane's jobs apart); jobs, spend, undelivered stories and
the provider's refusals over the last hour and day; today's budget and the
shared rate limiter as they stand."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from litestar import get
from litestar.di import NamedDependency

from api.deps import ApiState
from api.ops.schemas import (
    BudgetToday,
    JobCounts,
    JobWindows,
    Limiter,
    LimitKind,
    Overview,
    Provider,
    ProviderCounts,
    Queue,
    Snapshots,
    Spend,
    SpendCounts,
    Undelivered,
    UndeliveredCounts,
    usd,
)
from api.problems import problem_responses
from shared.config import ApiSettings
from shared.console_rows import OpsOverviewRow, RateBucketRow
from shared.console_stats import finished_since, snapshot_warning
from shared.console_store import ConsoleStore
from shared.ratelimit import RateLimits
from shared.rows import BudgetDay, SnapshotAges
from shared.store import budget_days_today, database_snapshot_ages, job_id_bounds

DAY = timedelta(days=1)


def _job_counts(completed: int, failed: int, cancelled: int) -> JobCounts:
    finished = completed + failed - cancelled
    ratio = None if finished == 0 else round((failed - cancelled) / finished, 4)
    return JobCounts(completed=completed, failed=failed, cancelled=cancelled, failure_ratio=ratio)


def _budget_today(days: list[BudgetDay], settings: ApiSettings) -> BudgetToday:
    everyone = next((day for day in days if day.client_id == 0), None)
    spent = everyone.spent_usd if everyone else Decimal(0)
    reserved = everyone.reserved_usd if everyone else Decimal(0)
    budget = settings.budget_usd_per_day
    return BudgetToday(spent_usd=usd(spent), reserved_usd=usd(reserved),
                       budget_usd=None if budget is None else usd(budget),
                       left_usd=None if budget is None else usd(max(budget - spent - reserved, Decimal(0))))


def _limiter(buckets: list[RateBucketRow], settings: ApiSettings) -> Limiter:
    limits = RateLimits.from_settings(settings)
    bucket = next((b for b in buckets if b.model == settings.llm_model), None)

    def kind(name: str) -> LimitKind | None:
        rate, capacity = limits.rate(name), getattr(limits, f"{name}_capacity")
        if rate is None or capacity is None:
            return None
        # refilled by the query; no row yet: a worker's start writes it full
        refilled: float | None = None if bucket is None else getattr(bucket, name)
        available = capacity if refilled is None else refilled
        return LimitKind(available=round(available, 3), capacity=capacity, per_minute=rate * 60)

    return Limiter(model=settings.llm_model, paused_s=round(bucket.paused_s, 3) if bucket else 0.0,
                   requests=kind("requests"), input_tokens=kind("input_tokens"), output_tokens=kind("output_tokens"))


def _snapshots(ages: SnapshotAges, settings: ApiSettings) -> Snapshots:
    def seen(age: float | None) -> float | None:
        return None if not ages.known or age is None else round(age, 3)

    return Snapshots(known=ages.known, oldest_transaction_age_s=seen(ages.oldest_transaction_age_s),
                     oldest_snapshot_age_s=seen(ages.oldest_snapshot_age_s),
                     replication_slot_xmin_age=ages.replication_slot_xmin_age,
                     warn_after_s=settings.xmin_horizon_warn_s,
                     warning=snapshot_warning(ages, settings.xmin_horizon_warn_s))


def _overview(row: OpsOverviewRow, settings: ApiSettings, budgets: list[BudgetDay],
              buckets: list[RateBucketRow], writers: list[str], ages: SnapshotAges) -> Overview:
    return Overview(
        writers=writers,
        snapshots=_snapshots(ages, settings),
        generated_at=datetime.now(UTC),
        queue=Queue(pending=row.pending, running=row.running,
                    oldest_pending_age_s=round(row.oldest_pending_age_s, 3), queue_max=settings.queue_max,
                    batch_live=row.batch_live, batch_queue_max=settings.batch_queue_max),
        jobs=JobWindows(
            last_hour=_job_counts(row.hour_completed, row.hour_failed, row.hour_cancelled),
            last_day=_job_counts(row.day_completed, row.day_failed, row.day_cancelled),
        ),
        spend=Spend(
            last_hour=SpendCounts(usd=usd(row.hour_spend_usd), billed_calls=row.hour_billed_calls,
                                  input_tokens=row.hour_input_tokens, output_tokens=row.hour_output_tokens),
            last_day=SpendCounts(usd=usd(row.day_spend_usd), billed_calls=row.day_billed_calls,
                                 input_tokens=row.day_input_tokens, output_tokens=row.day_output_tokens),
            today=_budget_today(budgets, settings),
        ),
        undelivered=Undelivered(
            last_hour=UndeliveredCounts(jobs=row.hour_undelivered, usd=usd(row.hour_undelivered_usd)),
            last_day=UndeliveredCounts(jobs=row.day_undelivered, usd=usd(row.day_undelivered_usd)),
        ),
        provider=Provider(
            last_hour=ProviderCounts(rate_limited=row.hour_rate_limited, overloaded=row.hour_overloaded),
            last_day=ProviderCounts(rate_limited=row.day_rate_limited, overloaded=row.day_overloaded),
            limiter=_limiter(buckets, settings),
        ),
    )


@get(
    "/overview",
    summary="The queue now; jobs, spend, undelivered stories and the provider's refusals over the last hour and day",
    responses=problem_responses(400, 401, 503),
)
async def get_overview(api_state: NamedDependency[ApiState], store: NamedDependency[ConsoleStore]) -> Overview:
    settings = api_state.settings
    bounds = await job_id_bounds(store.conn, created_after=finished_since(settings, DAY), created_before=None)
    row = await store.stats.ops_overview(day_from_id=bounds.lo_id)
    budgets = await budget_days_today(store.conn)
    buckets = await store.stats.llm_rate_bucket_list(limits=RateLimits.from_settings(settings))
    writers = await store.stats.ops_writers_recent()
    ages = await database_snapshot_ages(store.conn)
    return _overview(row, settings, budgets, buckets, writers, ages)
