"""Budget rows are locked in one order, the all-clients row first, whatever
plan Postgres picks: once ANALYZE makes budget_days a sequential scan and a
HOT update has put the all-clients row after a client's row on the page, the
budget trigger of a job's end and an admission still queue behind each other
instead of deadlocking."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg

from api.admission import admission
from api.store import ApiStore
from shared.config import ApiSettings
from shared.story_request import StoryRequest
from sweeper.store import PgSweeperStore
from tests.support.database import client_id_of, waiting_on_a_lock
from tests.support.waiting import wait_until

Conn = psycopg.AsyncConnection[Any]
BUDGET = Decimal(1000)


async def _admit(conn: Conn, client: int) -> list[Any]:
    return await ApiStore(conn).job_insert_if_admitted(
        admissions=[admission(client, uuid.uuid4().hex, StoryRequest(prompt="a fox"), ApiSettings())],
        queue_max=1000, client_queue_max=1000, budget_usd=BUDGET)


async def _rows_on_the_page(conn: Conn) -> list[int]:
    cur = await conn.execute("SELECT client_id FROM budget_days ORDER BY ctid")
    return [row[0] for row in await cur.fetchall()]


async def _plan(conn: Conn, client: int) -> str:
    """The plan of the statement the budget trigger of migrations 004-005 ran."""
    cur = await conn.execute(
        "EXPLAIN (COSTS OFF) UPDATE budget_days SET spent_usd = spent_usd "
        "WHERE client_id IN (0, %s) AND day = (now() AT TIME ZONE 'UTC')::date", (client,))
    return "\n".join(row[0] for row in await cur.fetchall())


async def test_a_jobs_end_and_an_admission_do_not_deadlock_on_a_seq_scanned_budget_page(
    database_url: str, conn: Conn
) -> None:
    """With the all-clients row after the client's row on the page and budget_days analysed into a
    sequential scan, a job's end (the sweeper's) waiting for the all-clients row (held by an admission's transaction)
    holds none of the client's, so the admission goes on and both commit."""
    client = await client_id_of(conn)
    (first,) = await _admit(conn, client)
    assert first.outcome == "inserted" and first.public_id is not None
    # a HOT update writes the all-clients row's new version after the client's row
    await conn.execute("UPDATE budget_days SET reserved_usd = reserved_usd WHERE client_id = 0")
    await conn.execute("ANALYZE budget_days")
    assert await _rows_on_the_page(conn) == [client, 0]
    assert "Seq Scan on budget_days" in await _plan(conn, client)

    async with await psycopg.AsyncConnection.connect(database_url) as admitting, \
            await psycopg.AsyncConnection.connect(database_url, autocommit=True) as cancelling:
        # an admission's transaction, between its two budget rows: the all-clients row is held
        await admitting.execute("UPDATE budget_days SET reserved_usd = reserved_usd WHERE client_id = 0")
        # the job's end is the sweeper's (queue_timeout): a client's cancel takes the admission lock first,
        # to give its turn back, and so queues behind the admission before any budget row
        cancel = asyncio.ensure_future(PgSweeperStore(cancelling).fail_stale(
            heartbeat_timeout_s=60, job_timeout_s=480, pending_timeout_s=1, judge_running=False,
            batch_size=10, lock_timeout_s=10, now=datetime.now(UTC) + timedelta(hours=1)))
        await wait_until(lambda: waiting_on_a_lock(conn), what="the job's end to wait for the all-clients row")
        # the admission's own statement locks the all-clients row, then the client's
        (second,) = await asyncio.wait_for(_admit(admitting, client), timeout=10)
        await admitting.commit()
        cancelled = await asyncio.wait_for(cancel, timeout=10)

    assert second.outcome == "inserted"
    assert [job.public_id for job in cancelled] == [first.public_id]
    worst = admission(client, "k", StoryRequest(prompt="a fox"), ApiSettings()).worst_case_usd
    cur = await conn.execute("SELECT client_id, spent_usd, reserved_usd FROM budget_days ORDER BY client_id")
    assert await cur.fetchall() == [(0, 0, worst), (client, 0, worst)]
