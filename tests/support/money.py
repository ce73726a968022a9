"""What the money invariants read and check: a job's charge, the day's budget
rows and the ledger, reckoned here in Python from the rows themselves, apart
from the database's own derivation (migration 019), so that a wrong
derivation is seen, not repeated.

A ledger row costs 0 when it was certainly not billed, its worst case while
its outcome is unknown (open, or interrupted: a worker that died, a job
ended mid-call, a lost batch), and what it reported otherwise; a job's charge
is the sum of its rows' once it has ended, none while it is live.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import date
from decimal import Decimal
from typing import Any

import psycopg

_UNKNOWN = ("started", "interrupted")


def row_charge(billed: bool, outcome: str, cost_usd: Decimal, worst_case_usd: Decimal) -> Decimal:
    """What one ledger row costs, as docs/limits-and-budgets.md defines it."""
    if not billed:
        return Decimal(0)
    return worst_case_usd if outcome in _UNKNOWN else cost_usd


async def _rows(conn: psycopg.AsyncConnection[Any], query: str) -> list[tuple[Any, ...]]:
    cur = await conn.execute(query)
    return await cur.fetchall()


async def money_problems(conn: psycopg.AsyncConnection[Any]) -> list[str]:
    """Every way the charges, the budget rows and the ledger disagree, as
    sentences (none: they agree):

    * an ended job's charged_usd is the sum of its ledger rows' charges, a
      live job has none;
    * an ended job's ledger rows are closed, or open knowingly: a batch's
      request whose result is still to be read;
    * each day's spent_usd (all clients, and each client) is the sum of the
      charges of its ended jobs that hold a reservation;
    * each day's reserved_usd is the sum of its live jobs' reservations.
    """
    problems: list[str] = []
    charges: dict[int, Decimal] = defaultdict(Decimal)
    open_rows: dict[int, list[tuple[int, bool]]] = defaultdict(list)
    for job_id, attempt, billed, outcome, cost, worst, batch_id, unread in await _rows(conn, """
            SELECT c.job_id, c.attempt, c.billed, c.outcome::text, c.cost_usd, c.worst_case_usd, c.batch_id,
                   EXISTS (SELECT 1 FROM message_batch_items i
                           WHERE i.batch_id = c.batch_id AND i.job_id = c.job_id AND i.attempt = c.attempt
                             AND i.result IS NULL)
            FROM llm_calls c"""):
        charges[job_id] += row_charge(billed, outcome, cost, worst)
        if outcome == "started":
            open_rows[job_id].append((attempt, batch_id is not None and unread))
    spent: dict[tuple[int, date], Decimal] = defaultdict(Decimal)
    reserved: dict[tuple[int, date], Decimal] = defaultdict(Decimal)
    for job_id, client_id, status, charged, reserved_usd, day in await _rows(conn, """
            SELECT id, client_id, status::text, charged_usd, reserved_usd, (created_at AT TIME ZONE 'UTC')::date
            FROM story_jobs"""):
        ended = status in ("completed", "failed")
        if not ended:
            if charged is not None:
                problems.append(f"live job {job_id} ({status}) has a charge of {charged}")
            for scope in (0, client_id):
                reserved[(scope, day)] += reserved_usd
            continue
        if charged != charges[job_id]:
            problems.append(f"job {job_id} ({status}) is charged {charged}, its ledger says {charges[job_id]}")
        unknowing = [attempt for attempt, knowingly in open_rows[job_id] if not knowingly]
        if unknowing:
            problems.append(f"job {job_id} ({status}) has ended with ledger rows open: attempts {unknowing}")
        if reserved_usd > 0:
            for scope in (0, client_id):
                spent[(scope, day)] += charged or Decimal(0)
    for client_id, day, spent_usd, reserved_usd in await _rows(
            conn, "SELECT client_id, day, spent_usd, reserved_usd FROM budget_days"):
        charged_sum = spent.pop((client_id, day), Decimal(0))
        if spent_usd != charged_sum:
            problems.append(f"budget day {day} of client {client_id} has spent {spent_usd}, "
                            f"its jobs' charges say {charged_sum}")
        reserved_sum = reserved.pop((client_id, day), Decimal(0))
        if reserved_usd != reserved_sum:
            problems.append(f"budget day {day} of client {client_id} holds {reserved_usd} in reservations, "
                            f"its live jobs {reserved_sum}")
    for what, left in (("charges", spent), ("reservations", reserved)):
        for (client_id, day), usd in left.items():
            if usd:
                problems.append(f"budget day {day} of client {client_id} has no row for {usd} of {what}")
    return problems
