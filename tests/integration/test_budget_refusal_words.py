"""What a POST refused for a spend budget is told: which budget has no
room, in the 429's words (api/enqueue.py)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from shared import store
from tests.support.api_client import api_client, assert_problem, new_key
from tests.support.database import client_id_of


@pytest.mark.parametrize("whose", ["the service's", "the client's own"])
async def test_a_story_refused_for_a_budget_is_told_which_budget(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, api_key: str, whose: str,
) -> None:
    """The 429 names the budget with no room: the service's for the day, or the client's own, which a
    client can ask its operator to raise."""
    tiny = Decimal("0.000001")
    if whose == "the client's own":
        await store.api_client_budget_set(conn, client_id=await client_id_of(conn, "tester"), budget_usd_per_day=tiny)
        settings: dict[str, Any] = {}
        words = "your spend budget for today"
    else:
        settings = {"budget_usd_per_day": tiny}
        words = "today's spend budget"
    async with api_client(pool, api_key, **settings) as client:
        answer = await client.post("/stories/generate", json={"prompt": "a fox"}, headers=new_key())
    body = assert_problem(answer, 429)
    assert body["type"] == "/problems/budget-exhausted"
    assert body["detail"].startswith(f"{words} has no room for this story's worst case; nothing was stored")
