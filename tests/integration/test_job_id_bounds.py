"""job_id_bounds (sql/common.sql) turns a time range into the narrowest
range of ids its binary search promises, in a few lookups: with ids in the
order of their creation, the first id created at or after the lower time
less 5 minutes, and the first created at or after the upper time plus 5
minutes. Under the statement timeout the services run with, so that a
search that did not end would fail here as it would there."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from shared import store
from tests.support import ops_seed as seed

MARGIN = timedelta(minutes=5)


async def test_the_bounds_are_the_first_ids_past_each_time_and_its_margin(conn: psycopg.AsyncConnection[Any]) -> None:
    """300 jobs created 10 s apart: for each probe time, lo_id is the first id created at or after it less
    5 minutes (one past the last when none is) and hi_id the first created at or after it plus 5 minutes."""
    client_id, _ = await seed.client(conn, "acme")
    base = datetime(2026, 1, 1, tzinfo=UTC)
    for n in range(300):
        await conn.execute(
            "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, created_at, turn) "
            "VALUES (%s, %s, '\\x00', '{}', %s, 0)", (client_id, uuid.uuid4().hex, base + timedelta(seconds=10 * n)))
    cur = await conn.execute("SELECT id, created_at FROM story_jobs ORDER BY id")
    rows = await cur.fetchall()
    past_last = rows[-1][0] + 1

    def first_at_or_after(moment: datetime) -> int:
        return int(next((job_id for job_id, at in rows if at >= moment), past_last))

    await conn.execute("SET statement_timeout = '5s'")
    for probe in [base + timedelta(seconds=s) for s in (-900, 0, 7, 333, 1500, 2990, 3100, 9000)]:
        bounds = await store.job_id_bounds(conn, created_after=probe, created_before=probe)
        assert (bounds.lo_id, bounds.hi_id) == (first_at_or_after(probe - MARGIN),
                                                first_at_or_after(probe + MARGIN)), probe
