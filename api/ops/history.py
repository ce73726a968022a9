"""GET /ops/api/history: jobs finished, queue depth, wait and run time
percentiles, spend and 429s over an hour, a day or a week, in about a hundred
bars, from the sweeper's per-minute rollup."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Annotated, Any

from litestar import get
from litestar.di import NamedDependency
from litestar.params import QueryParameter

from api.ops.schemas import History, HistoryBucket, Percentiles, usd
from api.problems import problem_responses
from shared.console_rows import RollupMinuteRow
from shared.console_store import ConsoleStore
from shared.rows import ROLLUP_BOUNDS_S

HOUR = timedelta(hours=1)
DAY = timedelta(days=1)
# range -> (its length, the minutes of one bucket): about a hundred bars each
# (the database sums the rollup's minutes into them, aligned on _EPOCH)
HISTORY_RANGES = {"hour": (HOUR, 1), "day": (DAY, 15), "week": (7 * DAY, 60)}
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


def _percentile(counts: list[int], share: float) -> float | None:
    """The upper bound of the bucket (ROLLUP_BOUNDS_S) holding
    the given share of the jobs counted; the last bound for the last bucket."""
    total = sum(counts)
    if not total:
        return None
    seen = 0
    for index, n in enumerate(counts):
        seen += n
        if seen >= share * total:
            return float(ROLLUP_BOUNDS_S[min(index + 1, len(ROLLUP_BOUNDS_S) - 1)])
    return float(ROLLUP_BOUNDS_S[-1])


def _add(into: list[int], counts: list[int]) -> None:
    for index, n in enumerate(counts[:len(into)]):
        into[index] += n


def _history(rows: list[RollupMinuteRow], range_: str, now: datetime) -> History:
    length, bucket_minutes = HISTORY_RANGES[range_]
    step = timedelta(minutes=bucket_minutes)
    epoch = _EPOCH
    last = epoch + (now - epoch) // step * step
    starts = [last - step * n for n in range(int(length / step) - 1, -1, -1)]
    index = {start: n for n, start in enumerate(starts)}
    sums: list[dict[str, Any]] = [
        {"completed": 0, "failed": 0, "cancelled": 0, "spend": Decimal(0), "rate_limited": 0, "pending_max": 0,
         "running_max": 0, "wait": [0] * len(ROLLUP_BOUNDS_S), "run": [0] * len(ROLLUP_BOUNDS_S)} for _ in starts]
    wait_all, run_all = [0] * len(ROLLUP_BOUNDS_S), [0] * len(ROLLUP_BOUNDS_S)
    for row in rows:
        n = index.get(epoch + (row.minute - epoch) // step * step)
        if n is None:
            continue
        bucket = sums[n]
        for name in ("completed", "failed", "cancelled", "rate_limited"):
            bucket[name] += getattr(row, name)
        bucket["spend"] += row.spend_usd
        bucket["pending_max"] = max(bucket["pending_max"], row.pending_max)
        bucket["running_max"] = max(bucket["running_max"], row.running_max)
        for name, counts, total in (("wait", row.wait_counts, wait_all), ("run", row.run_counts, run_all)):
            _add(bucket[name], counts)
            _add(total, counts)
    return History(
        range=range_, bucket_minutes=bucket_minutes,
        buckets=[HistoryBucket(
            at=start, completed=b["completed"], failed=b["failed"], cancelled=b["cancelled"], spend_usd=usd(b["spend"]),
            rate_limited=b["rate_limited"], pending_max=b["pending_max"], running_max=b["running_max"],
            **_percentiles(b["wait"], b["run"]),
        ) for start, b in zip(starts, sums, strict=True)],
        totals=Percentiles(**_percentiles(wait_all, run_all)),
    )


def _percentiles(wait_counts: list[int], run_counts: list[int]) -> dict[str, float | None]:
    return {"wait_p50_s": _percentile(wait_counts, 0.5), "wait_p95_s": _percentile(wait_counts, 0.95),
            "run_p50_s": _percentile(run_counts, 0.5), "run_p95_s": _percentile(run_counts, 0.95)}


@get(
    "/history",
    summary="Jobs finished, queue depth, wait and run time percentiles, spend and 429s over an hour, a day or a week",
    description="From the sweeper's per-minute rollup (minute_rollup), never from the jobs themselves.",
    responses=problem_responses(400, 401, 503),
)
async def get_history(
    store: NamedDependency[ConsoleStore],
    # named as the query parameter: refuse_unknown_query knows parameters by their names
    range: Annotated[str, QueryParameter(pattern="^(hour|day|week)$",  # noqa: A002
                                         description="hour (1-minute bars), day (15-minute) or week (hourly).")]
    = "hour",
) -> History:
    range_ = range
    length, bucket_minutes = HISTORY_RANGES[range_]
    now = datetime.now(UTC)
    rows = await store.stats.ops_history(since=now - length, step=timedelta(minutes=bucket_minutes),
                                         origin=_EPOCH)
    return _history(rows, range_, now)
