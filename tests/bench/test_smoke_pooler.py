"""The in-flight benchmark behind PgBouncer, end to end in quick mode.

No timing is asserted (the machine is shared and noisy): what is checked is
that the workers run every job through the pooler and that the figures are
measured and written.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.in_flight_pooler import POOL_SIZE
from tests.bench.smoke import run_quick
from tests.support import pgbouncer

pytestmark = [pytest.mark.system, pytest.mark.slow]


def test_quick_in_flight_behind_pgbouncer_runs_every_job_through_the_pool(server_url: str, tmp_path: Path) -> None:
    """`python -m tests.bench --quick --only in_flight_pooler` exits 0, every job ran and completed, the server
    connections stayed within the pooler's pool, and every figure of the benchmark is written."""
    if pgbouncer.binary() is None:
        pytest.skip("the pgbouncer binary is not installed (Debian package pgbouncer)")
    bench = run_quick("in_flight_pooler", server_url, tmp_path)["benchmarks"]["in_flight_pooler"]
    assert bench["error"] is None
    figures = {key: figure["median"] for key, figure in bench["figures"].items()}
    jobs = bench["params"]["jobs"]
    assert figures["jobs_running"] == jobs and figures["jobs_completed"] == jobs
    assert 1 <= figures["server_connections_peak"] <= POOL_SIZE
    assert figures["client_connections_peak"] >= bench["params"]["worker_processes"]
    assert figures["statements_per_s"] > 0 and figures["idle_statements_per_s"] > 0
    assert "worker_rss_per_job_kib" in figures
