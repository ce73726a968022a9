"""The claim rate that paces Retry-After and the time-remaining estimate is
read from a window of the newest 200 jobs (sql/api.sql, job_drain_stats):
the whole window counts, so up to 200 claims a minute are seen."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg

from api.admission import admission
from api.store import ApiStore
from shared.config import ApiSettings
from shared.story_request import StoryRequest
from tests.support.database import client_id_of

WINDOW = 200


async def test_a_minute_of_claims_filling_the_window_but_one_is_counted_whole(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """199 jobs claimed 10 s ago behind one claimed two minutes ago: the window of the newest 200 reaches back
    a minute, so all 199 of the last minute are counted (a window one job short would hold only the 199, read
    them as a burst younger than a minute, and count none)."""
    client = await client_id_of(conn)
    results = await ApiStore(conn).job_insert_if_admitted(
        admissions=[admission(client, uuid.uuid4().hex, StoryRequest(prompt=f"story {n}"), ApiSettings())
                    for n in range(WINDOW)],
        queue_max=1_000_000, client_queue_max=1_000_000)
    assert [r.outcome for r in results] == ["inserted"] * WINDOW
    await conn.execute("UPDATE story_jobs SET status = 'running', worker_id = 'w', heartbeat_at = now(), "
                       "started_at = now() - make_interval(secs => CASE WHEN id = (SELECT min(id) FROM story_jobs) "
                       "THEN 120 ELSE 10 END)")
    stats = await ApiStore(conn).job_drain_stats()
    assert stats.running == WINDOW
    assert stats.claimed_last_minute == WINDOW - 1
