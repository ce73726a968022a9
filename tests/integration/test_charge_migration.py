"""The migration that derives every charge from the ledger, on a database
migrated up to the version before it and holding the charges the old paths
wrote: each changed charge is reported by cause, and afterwards every charge
and budget row agrees with the ledger."""

from __future__ import annotations

from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from shared import migrate
from tests.support.money import money_problems
from tests.support.postgres_server import database_migrated_before

NAME = "money_follows_the_ledger"


@pytest.fixture
async def before(server_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A database migrated up to the version before the charges' derivation."""
    async with database_migrated_before(server_url, "storyjobs_charge_migration", NAME) as conn:
        yield conn


async def _job(conn: psycopg.AsyncConnection[Any], key: str, *, lane: str, status: str, error_code: str | None,
               reserved: str, charged: str) -> int:
    """A job as the old paths left it: ended, its terms (0.1 USD a million tokens in and out, 3,000 input
    tokens estimated, 1,000 max), its reservation and the charge its end wrote."""
    cur = await conn.execute(
        "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, status, error_code, "
        "lane, worker_id, started_at, completed_at, story_id, max_tokens, input_tokens_estimate, reserved_usd, "
        "charged_usd, model, input_usd_per_mtok, output_usd_per_mtok) "
        "VALUES (1, %s, '\\x00', '{}', %s, %s, %s, 'w', now(), now(), "
        "CASE WHEN %s = 'completed' THEN gen_random_uuid() END, 1000, 3000, %s, %s, 'm', 0.1, 0.1) RETURNING id",
        (key, status, error_code, lane, status, Decimal(reserved), Decimal(charged)))
    (job_id,) = await cur.fetchone() or (0,)
    return int(job_id)


async def _call(conn: psycopg.AsyncConnection[Any], job_id: int, *, outcome: str, billed: bool, cost: str) -> None:
    await conn.execute("INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model, finished_at, outcome, "
                       "billed, cost_usd) VALUES (%s, 1, 'w', 'anthropic', 'm', now(), %s, %s, %s)",
                       (job_id, outcome, billed, Decimal(cost)))


async def test_every_charge_is_brought_to_its_ledger_and_each_change_reported_by_cause(
    before: psycopg.AsyncConnection[Any],
) -> None:
    """A batch job cancelled in flight whose request was canceled (charged its reservation by the old path)
    comes down to 0, the day's spend with it; a job swept mid-call without a budget (charged 0) goes up to
    its worst case; a completed job stays at its cost; and the migration says so, by cause."""
    conn = before
    cancelled = await _job(conn, "a", lane="batch", status="failed", error_code="cancelled",
                           reserved="0.4", charged="0.4")
    await _call(conn, cancelled, outcome="canceled", billed=False, cost="0")
    swept = await _job(conn, "b", lane="interactive", status="failed", error_code="interrupted",
                       reserved="0", charged="0")
    await _call(conn, swept, outcome="interrupted", billed=True, cost="0")
    completed = await _job(conn, "c", lane="interactive", status="completed", error_code=None,
                           reserved="0", charged="0.000123")
    await _call(conn, completed, outcome="succeeded", billed=True, cost="0.000123")
    await conn.execute("INSERT INTO budget_days (client_id, day, spent_usd) "
                       "VALUES (0, (now() AT TIME ZONE 'UTC')::date, 0.4), (1, (now() AT TIME ZONE 'UTC')::date, 0.4)")

    applied = {m.name: m for m in await migrate.migrate(conn)}
    notices = applied[NAME].notices
    assert "charge re-derived from the ledger: 1 batch jobs (failed cancelled) down by 0.400000 USD" in notices
    # 3,000 input tokens at 3 bytes each and 1,000 output tokens, at 0.1 USD a million
    assert "charge re-derived from the ledger: 1 interactive jobs (failed interrupted) up by 0.001000 USD" in notices
    assert notices[-1] == "charges re-derived from the ledger: 2 jobs changed"
    cur = await conn.execute("SELECT id, charged_usd, worst_case_usd FROM story_jobs ORDER BY id")
    assert await cur.fetchall() == [(cancelled, Decimal(0), Decimal("0.4")),
                                    (swept, Decimal("0.001"), Decimal("0.001")),
                                    (completed, Decimal("0.000123"), Decimal("0.001"))]
    assert await money_problems(conn) == []
