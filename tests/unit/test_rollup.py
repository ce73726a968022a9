"""The history's buckets: the query that sums them and the percentiles read from them."""

from __future__ import annotations

import re

import pytest

from api.ops.history import _percentile
from shared.queries import QUERIES
from shared.rows import ROLLUP_BOUNDS_S


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
