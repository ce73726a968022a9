"""The fragments the named queries share, defined once (sql/017_one_definition.sql): each answers what
the expression it replaced answered, and the planner puts each in place, so that a statement's plan and
snapshot are those of the expression written out."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from shared.queries import QUERIES

SQL_DIR = Path(__file__).resolve().parents[2] / "sql"
_NAME = re.compile(r"^-- name: (\w+)", re.MULTILINE)
FUNCTIONS = {"budget_day": "i", "bucket_paused_s": "s", "bucket_held_now": "s", "bucket_refilled": "s"}
_USED = re.compile(r"\b(budget_day|bucket_paused_s|bucket_held_now|bucket_refilled|job_queue_depth)\b")
_LIMITS = {"requests_rate": 1.0, "requests_capacity": 5.0, "input_tokens_rate": None, "input_tokens_capacity": None,
           "output_tokens_rate": 100.0, "output_tokens_capacity": 500.0}
_ADMISSION = {"requests": '[{"ord": 0, "client_id": 1, "idempotency_key": "k", "request_fingerprint": "00", "lane": "interactive", '
                          '"request": {"prompt": "x"}, "max_tokens": 100, "input_tokens_estimate": 10, '
                          '"worst_case_usd": 0.1, "model": "m", "input_usd_per_mtok": 1, "output_usd_per_mtok": 1}]',
              "queue_max": 10, "client_queue_max": 10, "batch_queue_max": 10, "client_batch_queue_max": 10,
              "budget_usd": 5, "client_budget_usd": 5}
# the statements outside the worker's file that read a fragment, with parameters to plan them with
STATEMENTS: dict[str, dict[str, Any]] = {
    "job_drain_stats": {"model": "m"},
    "job_insert_if_admitted": _ADMISSION,
    "budget_days_today": {"now": None},
    "llm_rate_bucket_list": _LIMITS,
    "ops_overview": {"day_from_id": 1},
    "ops_client_today": {"from_id": 1, "day_start": datetime(2026, 1, 1, tzinfo=UTC)},
    "job_queue_gauges": {"now": None},
}


async def _one(conn: psycopg.AsyncConnection[Any], query: str, params: tuple[Any, ...] = ()) -> Any:
    cur = await conn.execute(query, params)
    row = await cur.fetchone()
    assert row is not None
    return row[0]


def test_the_statements_checked_are_every_reader_of_a_fragment_outside_the_workers_file() -> None:
    """Every named query of api.sql, console.sql, sweeper.sql and common.sql that reads a fragment is planned below
    (a named block of CTEs is not a statement: the statements that include it are)."""
    names = {name for file in ("api", "console", "sweeper", "common")
             for name in _NAME.findall((SQL_DIR / f"{file}.sql").read_text()) if not name.endswith("_ctes")}
    assert {name for name in names if _USED.search(QUERIES[name])} == set(STATEMENTS)


async def test_the_fragment_functions_are_marked_as_volatile_as_their_bodies(conn: psycopg.AsyncConnection[Any]) -> None:
    """Each is a SQL function, not strict, IMMUTABLE or STABLE as its body is: what the planner needs to inline it."""
    cur = await conn.execute("SELECT p.proname, l.lanname, p.provolatile, p.proisstrict FROM pg_proc p "
                             "JOIN pg_language l ON l.oid = p.prolang WHERE p.proname = ANY (%s)", (list(FUNCTIONS),))
    found = {name: (language, volatility, strict) for name, language, volatility, strict in await cur.fetchall()}
    assert found == {name: ("sql", volatility, False) for name, volatility in FUNCTIONS.items()}


@pytest.mark.parametrize("generic", [False, True], ids=["custom-plan", "generic-plan"])
async def test_every_statement_has_its_fragments_put_in_place(
    conn: psycopg.AsyncConnection[Any], generic: bool
) -> None:
    """No statement's plan calls a fragment function (each is inlined into the statement), with the parameters
    known or not. (Which indexes the statements read, job_queue_depth's included: test_explain.py and
    test_ops_explain.py.)"""
    await conn.execute("INSERT INTO api_clients (name) VALUES ('fragments')")
    await conn.execute("INSERT INTO llm_rate_buckets (model, requests, output_tokens) VALUES ('m', 3, 100)")
    for name, params in STATEMENTS.items():
        async with conn.transaction(force_rollback=True):
            if generic:
                await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            # a statement run with parameters is planned as psycopg prepares it
            cur = await conn.execute("EXPLAIN (VERBOSE, COSTS OFF) " + QUERIES[name], params)
            plan = "\n".join(row[0] for row in await cur.fetchall())
        called = sorted(set(re.findall(r"\b(" + "|".join(FUNCTIONS) + r")\(", plan)))
        assert called == [], (name, called)


async def test_budget_day_is_the_utc_day(conn: psycopg.AsyncConnection[Any]) -> None:
    """A time late on a day west of Greenwich is already the next UTC day."""
    at = datetime(2026, 1, 1, 23, 30, tzinfo=UTC) - timedelta(hours=-2)
    assert await _one(conn, "SELECT budget_day(%s)", (at,)) == (at.astimezone(UTC)).date()
    assert str(await _one(conn, "SELECT budget_day('2026-01-01 23:30-02')")) == "2026-01-02"


async def test_bucket_paused_s_is_what_is_left_of_a_pause(conn: psycopg.AsyncConnection[Any]) -> None:
    """No pause (NULL, -infinity, one that ended) is 0; a pause ending in 10 s is about 10."""
    for gone in ("NULL", "'-infinity'", "now() - interval '1 hour'"):
        assert await _one(conn, f"SELECT bucket_paused_s({gone})") == 0.0, gone
    assert 9.0 < await _one(conn, "SELECT bucket_paused_s(now() + interval '10 seconds')") <= 10.0


async def test_bucket_held_now_refills_at_a_known_rate_and_keeps_what_is_stored_otherwise(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """Without a rate the stored level (or NULL) is kept; with one, the level grows by rate x seconds, capped."""
    assert await _one(conn, "SELECT bucket_held_now(2.5, NULL, 5, now() - interval '1 hour')") == 2.5
    assert await _one(conn, "SELECT bucket_held_now(NULL, NULL, 5, now())") is None
    assert 2.9 <= await _one(conn, "SELECT bucket_held_now(1, 1, 5, now() - interval '2 seconds')") <= 3.1
    assert await _one(conn, "SELECT bucket_held_now(1, 1, 5, now() - interval '1 hour')") == 5.0
    # a kind nothing was written for was empty when written
    assert 1.9 <= await _one(conn, "SELECT bucket_held_now(NULL, 1, 5, now() - interval '2 seconds')") <= 2.1


async def test_job_queue_depth_counts_the_live_jobs_and_dates_the_oldest_pending(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """Pending and running jobs are counted apart, finished ones not at all; the oldest pending job's creation is
    given, NULL with none pending."""
    assert await (await conn.execute("SELECT pending, running, oldest_pending_created_at FROM job_queue_depth")
                  ).fetchone() == (0, 0, None)
    await conn.execute("INSERT INTO api_clients (name) VALUES ('fragments')")
    await conn.execute(
        "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, turn, created_at) "
        "SELECT 1, 'k' || g, '\\x00', '{}', g, '2026-01-01'::timestamptz + make_interval(secs => g) "
        "FROM generate_series(1, 6) g")
    await conn.execute("UPDATE story_jobs SET status = 'running', started_at = now(), heartbeat_at = now(), "
                       "worker_id = 'w' WHERE id IN (1, 2)")
    await conn.execute("UPDATE story_jobs SET status = 'completed', started_at = now(), completed_at = now(), "
                       "story_id = gen_random_uuid(), worker_id = 'w' WHERE id = 3")
    row = await (await conn.execute("SELECT pending, running, oldest_pending_created_at FROM job_queue_depth")
                 ).fetchone()
    assert row == (3, 2, datetime(2026, 1, 1, 0, 0, 4, tzinfo=UTC))
