"""The sweeper's per-minute rollup (rollup_minutes) keeps how long jobs ran
as a histogram of the stories written: a failed job's time, however long it
ran, is no story's time to write, and is left out (the console's history
reads these counts)."""

from __future__ import annotations

from typing import Any

import psycopg

from sweeper.store import PgSweeperStore
from tests.support import ops_seed as seed
from tests.support.settings import sweeper_settings


async def test_the_run_histogram_counts_the_completed_jobs_and_not_the_failed_ones(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """Three jobs that ran 80 s and ended two minutes ago, two completed and one failed after its call: the
    minutes' run counts add up to two, and their wait counts (all three were claimed) to three."""
    acme, _ = await seed.client(conn, "acme")
    await seed.insert_jobs(conn, [seed.completed(acme, 120), seed.completed(acme, 120),
                                  seed.failed(acme, 120, "llm_error", calls=[seed.Call("failed", billed=False)])])
    await PgSweeperStore(conn).record_minutes(sweeper_settings(sweeper_interval_s=30.0), pending=0, running=0)
    cur = await conn.execute("SELECT sum(n) FROM minute_rollup, unnest(run_counts) n")
    assert await cur.fetchone() == (2,)
    cur = await conn.execute("SELECT sum(n) FROM minute_rollup, unnest(wait_counts) n")
    assert await cur.fetchone() == (3,)
