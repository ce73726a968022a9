"""The history's buckets: the query that sums them and the percentiles read from them."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from api.ops.history import _percentile
from shared.queries import QUERIES
from shared.rows import ROLLUP_BOUNDS_S
from sweeper import rollup
from tests.support.settings import sweeper_settings


def test_the_history_query_sums_every_bucket_of_the_bounds() -> None:
    """ops_history names one sum per element of ROLLUP_BOUNDS_S, for the wait and the run histograms alike."""
    for column in ("wait_counts", "run_counts"):
        summed = [int(n) for n in re.findall(rf"sum\({column}\[(\d+)\]\)", QUERIES["ops_history"])]
        assert summed == list(range(1, len(ROLLUP_BOUNDS_S) + 1)), column


@pytest.mark.parametrize(("counts", "share", "expected"), [
    ([0] * len(ROLLUP_BOUNDS_S), 0.5, None),
    # all in the bucket [10, 15): reported as 15
    ([0] * 7 + [4] + [0] * (len(ROLLUP_BOUNDS_S) - 8), 0.95, 15.0),
    # 19 fast (under 0.5 s) and one slow (over an hour): p50 0.5, p95 0.5, p99 the last bound
    ([19] + [0] * (len(ROLLUP_BOUNDS_S) - 2) + [1], 0.5, 0.5),
    ([19] + [0] * (len(ROLLUP_BOUNDS_S) - 2) + [1], 0.99, 3600.0),
])
def test_a_percentile_is_the_upper_bound_of_the_bucket_that_reaches_it(
    counts: list[int], share: float, expected: float | None
) -> None:
    """A percentile of a histogram is the upper bound of the first bucket whose running count reaches that share;
    the last bucket, which has none, reports its lower bound."""
    assert _percentile(counts, share) == expected


NOW = datetime(2026, 3, 1, 12, 30, 40, tzinfo=UTC)


def test_a_pass_right_after_the_last_recounts_only_the_late_commit_window() -> None:
    """With the last pass's minute inside the late-commit window, a pass recounts that window alone (3 minutes
    for a 30 s interval), whatever the history holds."""
    settings = sweeper_settings(sweeper_interval_s=30.0)
    from_minute, _ = rollup.window(settings, NOW, NOW.replace(second=0) - timedelta(minutes=1))
    assert from_minute == datetime(2026, 3, 1, 12, 27, tzinfo=UTC)
    assert rollup.window(settings, NOW, None)[0] == from_minute


def test_a_pass_after_an_outage_recounts_from_the_last_minute_written_up_to_what_is_kept() -> None:
    """After two hours without a pass the next one recounts from the last minute written, so the minutes missed
    are filled; after two weeks, only the eight days the rollup keeps."""
    settings = sweeper_settings(sweeper_interval_s=30.0)
    last = datetime(2026, 3, 1, 10, 29, tzinfo=UTC)
    from_minute, oldest = rollup.window(settings, NOW, last)
    assert from_minute == last
    # a job counted from there was created at most its timeouts (and a margin) before
    assert oldest == last - timedelta(seconds=settings.pending_timeout_s + settings.job_timeout_s, minutes=10)
    assert rollup.window(settings, NOW, NOW - timedelta(days=14))[0] == NOW.replace(second=0) - timedelta(days=8)
