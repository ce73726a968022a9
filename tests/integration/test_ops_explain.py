"""The console's queries read history by primary key ranges and live jobs on
the live-jobs index, never by scanning story_jobs, so that they need no
index of their own and stay cheap at millions of rows."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from shared.queries import QUERIES
from shared.rows import ROLLUP_BOUNDS_S

FINISHED = 20_000
PENDING = 50
# the partial indexes that hold only live jobs: a read through any costs what the queue holds
LIVE_INDEXES = {"story_jobs_active_idx", "story_jobs_turn_idx", "story_jobs_batch_live_idx"}
NO_FILTER = {"status": None, "client_id": None, "error_code": None, "created_after": None, "created_before": None}


async def _fill(conn: psycopg.AsyncConnection[Any], *, analyze_first: bool) -> datetime:
    """FINISHED finished jobs a second apart, then PENDING pending ones; with analyze_first the statistics are
    taken while every row was pending. Returns the first job's creation time."""
    await conn.execute("INSERT INTO api_clients (name) VALUES ('explain')")
    await conn.execute(
        "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, turn, created_at) "
        "SELECT 1, 'k' || g, '\\x00', '{}', g, '2026-01-01'::timestamptz + make_interval(secs => g) "
        "FROM generate_series(1, %s) g", (FINISHED + PENDING,))
    if analyze_first:
        await conn.execute("ANALYZE story_jobs")
    await conn.execute(
        "UPDATE story_jobs SET status = 'failed', error_code = CASE WHEN id %% 9 = 0 THEN 'timed_out' "
        "ELSE 'llm_error' END, started_at = created_at, completed_at = created_at + interval '1 minute', "
        "worker_id = 'old' WHERE id <= %s", (FINISHED,))
    if not analyze_first:
        await conn.execute("VACUUM ANALYZE story_jobs")
    return datetime.fromisoformat("2026-01-01T00:00:01+00:00")


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found.extend(_nodes(child))
    return found


async def _scans(conn: psycopg.AsyncConnection[Any], query: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """The plan's nodes that read story_jobs: scans of the table and of its indexes."""
    cur = await conn.execute("EXPLAIN (FORMAT JSON) " + QUERIES[query], params)
    row = await cur.fetchone()
    assert row is not None
    return [node for node in _nodes(row[0][0]["Plan"]) if "Scan" in node["Node Type"]
            and (node.get("Relation Name") == "story_jobs" or str(node.get("Index Name", "")).startswith("story_jobs"))]


def _kinds(scans: list[dict[str, Any]]) -> set[str]:
    return {f"{scan['Node Type']}:{scan.get('Index Name', '')}" for scan in scans}


@pytest.mark.parametrize("filters", [
    {},
    {"status": "failed"},
    {"error_code": "timed_out"},
    {"client_id": 1, "status": "completed"},
    # the id range of the time range, as job_id_bounds would give it
    {"created_after": "2026-01-01T03:55:00Z", "created_before": "2026-01-01T04:05:00Z"},
], ids=["none", "status", "error-code", "client", "time-range"])
async def test_the_jobs_list_walks_the_primary_key_down_its_id_range(
    conn: psycopg.AsyncConnection[Any], filters: dict[str, Any]
) -> None:
    """Whatever the filters, the history walk of ops_job_list reads story_jobs only on its primary key, bounded by before_id and
    floor_id: the cost of a page is the stretch of ids (5 % of this table, as SCAN_IDS is 2 % of a million
    jobs), never the table. Mostly a backward walk that stops at the page's last row."""
    await _fill(conn, analyze_first=False)
    params = {**NO_FILTER, **filters, "live": False, "before_id": 15_000, "floor_id": 14_000,
              "before_created_at": None, "limit": 50}
    scans = await _scans(conn, "ops_job_list", params)
    assert not any(scan["Node Type"] == "Seq Scan" for scan in scans), _kinds(scans)
    bounded = [scan for scan in scans if scan.get("Index Name") == "story_jobs_pkey"]
    assert len(bounded) == 1 and _kinds(scans) - _kinds(bounded) <= {"Bitmap Heap Scan:"}, _kinds(scans)
    assert "id < " in bounded[0]["Index Cond"] and "id >= " in bounded[0]["Index Cond"], bounded[0]["Index Cond"]
    if set(filters) <= {"status", "error_code"}:
        # a planner that expects few matches may also collect the range as a bitmap: still bounded
        assert bounded[0]["Node Type"] == "Index Scan" and bounded[0]["Scan Direction"] == "Backward"


@pytest.mark.parametrize("analyze_first", [False, True], ids=["fresh-stats", "stale-stats"])
async def test_live_lists_read_the_live_jobs_index(conn: psycopg.AsyncConnection[Any], analyze_first: bool) -> None:
    """The running list walks story_jobs_active_idx backwards in its own order, which the primary key cannot
    give, also with statistics taken while every job was pending; the pending list reads a live-jobs index
    (the active one, or the claim's turn index, which holds only pending jobs), never the table."""
    await _fill(conn, analyze_first=analyze_first)
    live = {**NO_FILTER, "live": True, "before_created_at": None, "before_id": None, "floor_id": None, "limit": 50}
    (scan,) = await _scans(conn, "ops_job_list", {**live, "status": "running", "client_id": 1})
    assert (scan["Node Type"], scan["Index Name"], scan["Scan Direction"]) == (
        "Index Scan", "story_jobs_active_idx", "Backward")
    assert "status = " in scan["Index Cond"] and "ROW(created_at, id) < " in scan["Index Cond"]
    scans = await _scans(conn, "ops_job_list", {**live, "status": "pending"})
    assert not any(scan["Node Type"] == "Seq Scan" for scan in scans), _kinds(scans)
    assert {scan["Index Name"] for scan in scans if "Index Name" in scan} <= LIVE_INDEXES, _kinds(scans)


async def test_a_cancel_by_filter_counts_and_finds_its_jobs_on_the_live_jobs_index(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """The count shown before a cancel by filter and the cancel itself find pending jobs through
    a live-jobs index (story_jobs_active_idx, or the claim's turn index of pending jobs), and reach rows
    otherwise only by id. (Plain counts, as the sweeper's gauges: right with the fresh statistics that
    story_jobs' autovacuum settings keep.)"""
    await _fill(conn, analyze_first=False)
    for query, params in (("ops_job_count_pending", NO_FILTER),
                          ("ops_job_cancel_pending", {**NO_FILTER, "client_id": 1, "through_id": FINISHED + PENDING})):
        scans = await _scans(conn, query, params)
        assert any(scan.get("Index Name") in LIVE_INDEXES for scan in scans), (query, scans)
        for scan in scans:
            assert scan["Node Type"] != "Seq Scan", query
            # a bitmap heap scan reads what its bitmap index scan, checked on its own, found
            if scan.get("Index Name") not in LIVE_INDEXES and scan["Node Type"] != "Bitmap Heap Scan":
                assert "id = ANY" in scan.get("Index Cond", ""), (query, scan)


async def test_time_bounds_are_found_by_probing_the_primary_key(conn: psycopg.AsyncConnection[Any]) -> None:
    """job_id_bounds touches story_jobs only through its primary key: two ends and one row per probe."""
    first = await _fill(conn, analyze_first=False)
    params = {"created_after": first + timedelta(hours=1), "created_before": first + timedelta(hours=2)}
    scans = await _scans(conn, "job_id_bounds", params)
    assert {scan.get("Index Name") for scan in scans} == {"story_jobs_pkey"}
    assert not any(scan["Node Type"].startswith(("Seq", "Bitmap")) for scan in scans)


@pytest.mark.parametrize("query", ["ops_overview", "rollup_minutes"])
async def test_the_overview_reads_finished_jobs_from_an_id_up(conn: psycopg.AsyncConnection[Any], query: str) -> None:
    """The overview and the sweeper's history rollup read finished jobs on the primary key from the id the caller
    found (an index or bitmap scan), the batch lane's on their own index, and live jobs on the live-jobs index,
    never scanning the table."""
    first = await _fill(conn, analyze_first=False)
    scans = await _scans(conn, query, {
        "day_from_id": FINISHED - 500, "from_id": FINISHED - 100, "ending_from_id": FINISHED - 100, "pending": 0,
        "running": 0,
        "from_minute": first + timedelta(seconds=FINISHED - 60), "bounds_s": [float(b) for b in ROLLUP_BOUNDS_S]})
    assert not any(scan["Node Type"] == "Seq Scan" for scan in scans), _kinds(scans)
    indexes = {scan["Index Name"] for scan in scans if "Index Name" in scan}
    assert indexes <= {"story_jobs_pkey", "story_jobs_batch_finished_idx", *LIVE_INDEXES}, indexes
    assert any(scan.get("Index Name") == "story_jobs_pkey" and "id >= " in scan["Index Cond"] for scan in scans)


BATCHES = 3000
ITEMS_PER_BATCH = 4


async def _fill_batches(conn: psycopg.AsyncConnection[Any]) -> None:
    """BATCHES message batches of ITEMS_PER_BATCH requests each, every request with its ledger row, beside as
    many interactive ledger rows again."""
    await conn.execute(
        "INSERT INTO message_batches (state, provider_batch_id, model, request_count, expires_at) "
        "SELECT 'ended', 'msgbatch_' || g, 'm', %s, now() FROM generate_series(1, %s) g", (ITEMS_PER_BATCH, BATCHES))
    await conn.execute(
        "INSERT INTO message_batch_items (batch_id, custom_id, job_id, attempt, result) "
        "SELECT b, 'sj-' || b || '-' || (b * 10 + n) || '-1', b * 10 + n, 1, 'succeeded' "
        "FROM generate_series(1, %s) b, generate_series(1, %s) n", (BATCHES, ITEMS_PER_BATCH))
    await conn.execute(
        "INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model, outcome, finished_at, cost_usd, batch_id) "
        "SELECT job_id, attempt, 'w', 'anthropic', 'm', 'succeeded', now(), 0.001, batch_id FROM message_batch_items")
    await conn.execute(
        "INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model, outcome, finished_at, cost_usd) "
        "SELECT 10000000 + g, 1, 'w', 'anthropic', 'm', 'succeeded', now(), 0.002 FROM generate_series(1, %s) g",
        (BATCHES * ITEMS_PER_BATCH,))
    await conn.execute("VACUUM ANALYZE message_batches, message_batch_items, llm_calls")


@pytest.mark.parametrize("before_id", [None, BATCHES // 2], ids=["newest", "deeper"])
async def test_the_batches_list_walks_the_batches_down_their_primary_key_and_their_cost_by_ledger_keys(
    conn: psycopg.AsyncConnection[Any], before_id: int | None,
) -> None:
    """ops_batch_list reads message_batches backwards on its primary key from the cursor, and each batch's cost
    through its items' primary key and each item's ledger row by the ledger's primary key: a page costs its
    batches' requests, never a scan of the batches, their items or the ledger."""
    await _fill_batches(conn)
    cur = await conn.execute("EXPLAIN (FORMAT JSON) " + QUERIES["ops_batch_list"], {"before_id": before_id,
                                                                                     "limit": 51})
    row = await cur.fetchone()
    assert row is not None
    scans = [node for node in _nodes(row[0][0]["Plan"]) if "Scan" in node["Node Type"]]
    assert not any(scan["Node Type"] == "Seq Scan" for scan in scans), _kinds(scans)
    batches = next(scan for scan in scans if scan.get("Index Name") == "message_batches_pkey")
    assert batches["Node Type"] == "Index Scan" and batches["Scan Direction"] == "Backward"
    # a bitmap heap scan reads what its bitmap index scan found
    assert {scan["Index Name"] for scan in scans if scan["Node Type"] != "Bitmap Heap Scan"} == {
        "message_batches_pkey", "message_batch_items_pkey", "llm_calls_pkey"}, _kinds(scans)
    items = next(scan for scan in scans if scan.get("Index Name") == "message_batch_items_pkey")
    assert "batch_id = b.id" in items["Index Cond"], items
