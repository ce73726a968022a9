"""The console's history list after a prune: the first ids are gone, and
the list ends at the oldest job left (job_id_bounds' lo_id is the first id
there is, not 1)."""

from __future__ import annotations

import math
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from api.ops import paging
from tests.support import ops_seed as seed
from tests.support.api_client import api_client
from tests.support.ops_jobs_list import every_page, expected_ids, history


async def test_a_pruned_history_is_listed_down_to_its_oldest_job_left_and_no_further(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a prune the first ids are long gone: the list's last page is the one holding the oldest job
    left, not one of many empty stretches walked down to id 1."""
    monkeypatch.setattr(paging, "SCAN_IDS", 7)
    # the ids a year of prunes would leave: the first 1,000 gone
    await conn.execute("SELECT setval(pg_get_serial_sequence('story_jobs', 'id'), 1000)")
    await history(conn)
    expected = await expected_ids(conn, "true", {}, False)
    key = await seed.operator_key(conn)
    async with api_client(pool, key) as client:
        found, requests = await every_page(client, {}, limit=3)
    assert found == expected
    # at most a request per page of 3 and one more per stretch of 7 ids (a page the stretch cut short);
    # walking the 1,000 ids gone would take about 140 more
    assert requests <= math.ceil(len(expected) / 3) + math.ceil(len(expected) / 7) + 1
