"""ops_list: the operators' jobs list (GET /ops/api/jobs) at 1,000,000 jobs.

One database holding 1,000,000 finished jobs (one INSERT ... SELECT
generate_series: harness.insert_finished, 19 completed to 1 failed) and one
ledger row each (one INSERT ... SELECT from story_jobs), then VACUUM ANALYZE
as autovacuum would have; one ``python -m api`` process and an operator key.
From this process, over one keep-alive connection, requests one after the
other, each case in turn in blocks so that all see the same machine:

* first page: the newest 50 jobs;
* deep page: 50 jobs from a cursor 990,000 jobs down (99 % of the way);
* failed, first page: 50 of the failed jobs (1 in 20), newest first;
* no match: a filter that matches no job (error_code=queue_timeout), so the
  request walks its whole stretch of ids (SCAN_IDS) and answers an empty
  page with a cursor: the most one request can cost.

The latency is the client's: HTTP, the api's Python, and the two statements
(the ids' bounds, then the page), after a warm-up. Targets: p99 of the first
and the deep page at most 50 ms.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import psycopg

from api.ops.cursor import Position
from api.ops.paging import SCAN_IDS
from shared import keys
from tests.bench.harness import BenchContext, BenchDatabase, BenchResult, FigureSpec, percentile

NAME = "ops_list"
PAGE = 50
CASES = {
    "first": ("first page", {}),
    "deep": ("deep page (a cursor 99 % down the history)", {}),
    "failed": ("failed jobs, first page", {"status": "failed"}),
    "nomatch": (f"a filter matching nothing ({SCAN_IDS:,} ids walked)", {"error_code": "queue_timeout"}),
}
SPECS: dict[str, FigureSpec] = {}
for _case, (_label, _) in CASES.items():
    SPECS[f"{_case}_p50_ms"] = FigureSpec(f"GET /ops/api/jobs, {_label}, p50", "ms")
    SPECS[f"{_case}_p99_ms"] = FigureSpec(f"GET /ops/api/jobs, {_label}, p99", "ms")
WARMUP = 20
BLOCK = 25


def run(ctx: BenchContext, result: BenchResult) -> None:
    jobs = 50_000 if ctx.quick else 1_000_000
    requests = 100 if ctx.quick else 500
    deep_id = jobs // 100
    result.params.update({"finished_jobs": jobs, "ledger_rows": jobs, "page_size": PAGE,
                          "requests_per_case_per_run": requests, "scan_ids": SCAN_IDS,
                          "deep_cursor_below_id": deep_id})
    with ctx.database("ops_list") as bench_db:
        built = time.monotonic()
        _fill(bench_db, jobs)
        key = asyncio.run(_operator_key(bench_db.url))
        ctx.progress(f"ops_list: {jobs:,} jobs and their ledger built in {time.monotonic() - built:.0f} s")
        with ctx.processes(bench_db) as system:
            api = system.api()
            cursors = {"deep": Position(id=deep_id).token()}
            with httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {key}"},
                              timeout=10) as client:
                _check(client, cursors)
                for run_number in range(1, ctx.runs + 1):
                    latencies = _measure(client, cursors, requests)
                    for case, measured in latencies.items():
                        result.add(f"{case}_p50_ms", percentile(measured, 50))
                        result.add(f"{case}_p99_ms", percentile(measured, 99))
                    ctx.progress(f"ops_list run {run_number}/{ctx.runs}: " + ", ".join(
                        f"{case} p50 {percentile(m, 50):.1f} ms p99 {percentile(m, 99):.1f} ms"
                        for case, m in latencies.items()))


def _fill(bench_db: BenchDatabase, jobs: int) -> None:
    client_id = bench_db.create_client()
    bench_db.insert_finished(client_id, jobs)
    with bench_db.connect() as conn:
        conn.execute(
            """
            INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model, started_at, finished_at, outcome,
                                   billed, input_tokens, output_tokens, cost_usd, request_id)
            SELECT id, 1, worker_id, 'anthropic', 'claude-sonnet-5-5', started_at, completed_at,
                   CASE WHEN status = 'failed' THEN 'failed' ELSE 'succeeded' END, true, 300, progress,
                   0.0051, 'req_' || id
            FROM story_jobs
            """
        )
        conn.execute("VACUUM ANALYZE story_jobs")
        conn.execute("VACUUM ANALYZE llm_calls")


async def _operator_key(url: str) -> str:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return (await keys.create_operator(conn, "bench")).key


def _params(case: str, cursors: dict[str, str]) -> dict[str, Any]:
    params: dict[str, Any] = {"limit": PAGE, **CASES[case][1]}
    if case in cursors:
        params["cursor"] = cursors[case]
    return params


def _check(client: httpx.Client, cursors: dict[str, str]) -> None:
    """Each case answers what it should, before anything is timed."""
    for case in CASES:
        answer = client.get("/ops/api/jobs", params=_params(case, cursors))
        if answer.status_code != 200:
            raise RuntimeError(f"{case}: GET /ops/api/jobs answered {answer.status_code}: {answer.text[:300]}")
        page = answer.json()
        expected = 0 if case == "nomatch" else PAGE
        if len(page["jobs"]) != expected or page["next_cursor"] is None:
            raise RuntimeError(f"{case}: {len(page['jobs'])} jobs and cursor {page['next_cursor']!r}, "
                               f"expected {expected} and a cursor")


def _measure(client: httpx.Client, cursors: dict[str, str], requests: int) -> dict[str, list[float]]:
    latencies: dict[str, list[float]] = {case: [] for case in CASES}
    for case in CASES:
        for _ in range(WARMUP):
            client.get("/ops/api/jobs", params=_params(case, cursors)).raise_for_status()
    while any(len(measured) < requests for measured in latencies.values()):
        for case, measured in latencies.items():
            params = _params(case, cursors)
            for _ in range(min(BLOCK, requests - len(measured))):
                started = time.perf_counter()
                client.get("/ops/api/jobs", params=params).raise_for_status()
                measured.append((time.perf_counter() - started) * 1000)
    return latencies
