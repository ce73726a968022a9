"""Fair share (sql/009_fair_share.sql) through a refused admission: a client
whose request is refused, for its budget, after its queue was counted keeps
the end of its last turn, so its next job still waits behind its own queued
jobs and is not given the turn being served."""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import psycopg

from api.admission import admission
from api.store import ApiStore
from shared.config import ApiSettings
from shared.story_request import StoryRequest
from tests.support import worker_statements
from tests.support.database import client_id_of

CLIENT_QUEUE_MAX = 3


async def _admit(conn: psycopg.AsyncConnection[Any], client: int, *, client_budget: Decimal | None = None) -> str:
    (result,) = await ApiStore(conn).job_insert_if_admitted(
        admissions=[admission(client, uuid.uuid4().hex, StoryRequest(prompt="a fox"), ApiSettings())],
        queue_max=1000, client_queue_max=CLIENT_QUEUE_MAX, budget_usd=None, client_budget_usd=client_budget)
    return result.outcome


async def test_a_request_refused_after_its_queue_was_counted_keeps_the_clients_last_turn(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    client = await client_id_of(conn)
    assert [await _admit(conn, client) for _ in range(CLIENT_QUEUE_MAX)] == ["inserted"] * CLIENT_QUEUE_MAX
    claimed = await worker_statements.job_claim(conn, worker_id="w", claim_limit=1, provider="anthropic", model="m")
    assert len(claimed.claimed) == 1
    # the kept bound (3) leaves no room, so the queue is counted (2): the
    # bound is written back, though the budget refuses the request
    assert await _admit(conn, client, client_budget=Decimal("0.000001")) == "client_budget_exhausted"
    assert await _admit(conn, client) == "inserted"
    cur = await conn.execute("SELECT turn FROM story_jobs WHERE status = 'pending' ORDER BY id")
    queued = [turn for (turn,) in await cur.fetchall()]
    assert queued == [1.0, 2.0, 3.0]
