"""The in-flight benchmark behind PgBouncer, end to end in quick mode.

No timing is asserted (the machine is shared and noisy): what is checked is
that the workers run every job through the pooler and that the figures are
measured and written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import pgbouncer
from tests.bench.harness import REPO
from tests.bench.in_flight_pooler import POOL_SIZE

pytestmark = [pytest.mark.system, pytest.mark.slow]


def test_quick_in_flight_behind_pgbouncer_runs_every_job_through_the_pool(server_url: str, tmp_path: Path) -> None:
    """`python -m tests.bench --quick --only in_flight_pooler` exits 0, every job ran and completed, the server
    connections stayed within the pooler's pool, and every figure of the benchmark is written."""
    if pgbouncer.binary() is None:
        pytest.skip("the pgbouncer binary is not installed (Debian package pgbouncer)")
    finished = subprocess.run(
        [sys.executable, "-m", "tests.bench", "--quick", "--runs", "1", "--only", "in_flight_pooler",
         "--out", str(tmp_path), "--quiet"],
        cwd=REPO, env={**os.environ, "TEST_DATABASE_URL": server_url},
        capture_output=True, text=True, timeout=280, check=False,
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    bench = json.loads((tmp_path / "latest.json").read_text())["benchmarks"]["in_flight_pooler"]
    assert bench["error"] is None
    figures = {key: figure["median"] for key, figure in bench["figures"].items()}
    jobs = bench["params"]["jobs"]
    assert figures["jobs_running"] == jobs and figures["jobs_completed"] == jobs
    assert 1 <= figures["server_connections_peak"] <= POOL_SIZE
    assert figures["client_connections_peak"] >= bench["params"]["worker_processes"]
    assert figures["statements_per_s"] > 0 and figures["idle_statements_per_s"] > 0
    assert "worker_rss_per_job_kib" in figures
