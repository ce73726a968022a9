"""scale: the claim and the sweep must not slow down as history grows.

Two databases with the same 10,000 pending jobs, one of them also holding
1,000,000 finished jobs (bulk-inserted, then VACUUM ANALYZE as autovacuum
would have). On each, from one connection: job_claim with
claim_limit=1 repeated 2,000 times through worker.store (latency per call,
p50 and p99), then the claimed jobs are put back to pending and vacuumed;
then sweeper passes (Sweeper.sweep_once with the default settings), timed.
The two databases take turns (blocks of claims, single passes) so that both
are measured under the same load of a shared machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import statistics
import time
from collections.abc import Iterator
from typing import Any

from shared import db, store
from shared.config import SweeperSettings
from sweeper.store import PgSweeperStore
from sweeper.sweep import Sweeper
from tests.bench.harness import BenchContext, BenchDatabase, BenchResult, FigureSpec, percentile
from tests.support import worker_statements

NAME = "scale"
VARIANTS = ("empty", "history")
SPECS = {
    "claim_p50_ms_empty": FigureSpec("claim (claim_limit 1), p50, no finished rows", "ms"),
    "claim_p50_ms_history": FigureSpec("claim (claim_limit 1), p50, with the finished rows", "ms"),
    "claim_p99_ms_empty": FigureSpec("claim (claim_limit 1), p99, no finished rows", "ms"),
    "claim_p99_ms_history": FigureSpec("claim (claim_limit 1), p99, with the finished rows", "ms"),
    "claim_p99_ratio": FigureSpec("claim p99, with finished rows / without", "×"),
    "sweep_ms_empty": FigureSpec("one sweeper pass, no finished rows", "ms"),
    "sweep_ms_history": FigureSpec("one sweeper pass, with the finished rows", "ms"),
    "sweep_ratio": FigureSpec("sweeper pass, with finished rows / without", "×"),
}
WARMUP_CLAIMS = 20
CLAIM_BLOCK = 50
WORKER_ID = "bench-scale-claimer"

_RESET = [
    "DELETE FROM llm_calls",
    "UPDATE story_jobs SET status = 'pending', started_at = NULL, heartbeat_at = NULL, worker_id = NULL "
    "WHERE status = 'running'",
    "VACUUM ANALYZE story_jobs",
    "VACUUM ANALYZE llm_calls",
]


def run(ctx: BenchContext, result: BenchResult) -> None:
    finished = 50_000 if ctx.quick else 1_000_000
    pending = 2_000 if ctx.quick else 10_000
    claims = 300 if ctx.quick else 2_000
    sweeps = 3 if ctx.quick else 10
    result.params.update({
        "finished_rows": finished, "pending_rows": pending, "claims_per_run": claims,
        "sweeper_passes_per_run": sweeps, "sweeper_settings": "defaults (SweeperSettings())",
    })
    databases: dict[str, BenchDatabase] = {}
    try:
        for variant in VARIANTS:
            bench_db = ctx.create_database(f"scale_{variant}")
            databases[variant] = bench_db
            built = time.monotonic()
            client_id = bench_db.create_client()
            if variant == "history":
                bench_db.insert_finished(client_id, finished)
            bench_db.insert_pending(client_id, pending)
            ctx.progress(f"scale: {variant} database built in {time.monotonic() - built:.0f} s")
        for run_number in range(1, ctx.runs + 1):
            latencies, sweep_ms = asyncio.run(
                _measure(databases, result, claims=claims, sweeps=sweeps, explain=run_number == 1))
            for variant in VARIANTS:
                result.add(f"claim_p50_ms_{variant}", percentile(latencies[variant], 50))
                result.add(f"claim_p99_ms_{variant}", percentile(latencies[variant], 99))
                result.add(f"sweep_ms_{variant}", sweep_ms[variant])
            claim_ratio = percentile(latencies["history"], 99) / percentile(latencies["empty"], 99)
            sweep_ratio = sweep_ms["history"] / sweep_ms["empty"]
            result.add("claim_p99_ratio", claim_ratio)
            result.add("sweep_ratio", sweep_ratio)
            ctx.progress(f"scale run {run_number}/{ctx.runs}: claim p99 ratio {claim_ratio:.2f}, "
                         f"sweep ratio {sweep_ratio:.2f}")
    finally:
        for bench_db in databases.values():
            ctx.drop_database(bench_db)


async def _measure(databases: dict[str, BenchDatabase], result: BenchResult, *, claims: int, sweeps: int,
                   explain: bool) -> tuple[dict[str, list[float]], dict[str, float]]:
    latencies = await _claim_latencies(databases, result if explain else None, claims)
    for bench_db in databases.values():
        with bench_db.connect() as conn:
            for statement in _RESET:
                conn.execute(statement)
    sweep_ms = await _sweep_ms(databases, result, sweeps)
    return latencies, sweep_ms


def _turns(turn: int) -> tuple[str, ...]:
    """Which database goes first alternates, so neither always follows the other."""
    return VARIANTS if turn % 2 == 0 else VARIANTS[::-1]


async def _claim_latencies(databases: dict[str, BenchDatabase], explained: BenchResult | None,
                           claims: int) -> dict[str, list[float]]:
    """Latency of each claim, per database. The databases take turns in
    blocks of CLAIM_BLOCK claims, so that both see the same machine (it is
    shared, and its load changes by the second). With ``explained``, notes
    there how the first and the last claim found their row."""
    conns = {}
    try:
        for variant, bench_db in databases.items():
            conns[variant] = await db.connect(bench_db.url, **_worker_connection_settings())
        if explained is not None:
            for variant, conn in conns.items():
                explained.note(f"{variant}: first claim {await _claim_access_path(conn)}")
        for variant, conn in conns.items():
            for _ in range(WARMUP_CLAIMS):
                await _timed_claim(conn, databases[variant])
        latencies: dict[str, list[float]] = {variant: [] for variant in conns}
        turn = 0
        while any(len(measured) < claims for measured in latencies.values()):
            for variant in _turns(turn):
                for _ in range(min(CLAIM_BLOCK, claims - len(latencies[variant]))):
                    latencies[variant].append(await _timed_claim(conns[variant], databases[variant]))
            turn += 1
        if explained is not None:
            for variant, conn in conns.items():
                explained.note(f"{variant}: last claim {await _claim_access_path(conn)}")
    finally:
        for conn in conns.values():
            await conn.close()
    return latencies


async def _timed_claim(conn: store.Conn, bench_db: BenchDatabase) -> float:
    started = time.perf_counter()
    settled = await worker_statements.job_claim(conn, worker_id=WORKER_ID, claim_limit=1,
                                               provider="offline", model="offline-writer")
    elapsed_ms = (time.perf_counter() - started) * 1000
    if len(settled.claimed) != 1:
        raise RuntimeError(f"a claim found no pending job on {bench_db.name}")
    return elapsed_ms


def _worker_connection_settings() -> dict[str, Any]:
    """The session the worker's pool opens (worker/__main__.py): named like it,
    and planning its statements once (generic plans) where shared.db offers it."""
    settings: dict[str, Any] = {"application_name": "storyjobs-worker", "connect_timeout_s": 5,
                                "statement_timeout_s": 30}
    if "generic_plans" in inspect.signature(db.connect_kwargs).parameters:
        settings["generic_plans"] = True
    return settings


async def _claim_access_path(conn: store.Conn) -> str:
    """How the claim found its pending row: the worker's own call, run as
    EXPLAIN ANALYZE (it claims one job, as the measured calls do)."""
    explaining = _ExplainingConnection(conn)
    with contextlib.suppress(_Explained):
        # a stand-in for the connection, with only the execute the query function calls
        await worker_statements.job_claim(explaining, worker_id=WORKER_ID,  # type: ignore[arg-type]
                                         claim_limit=1, provider="offline",
                                         model="offline-writer")
    if explaining.plan is None:
        return "(plan not captured: worker_statements.job_claim no longer calls conn.execute)"
    claimable = next((node for node in _nodes(explaining.plan) if node.get("Subplan Name") == "CTE claimable"),
                     explaining.plan)
    scans = [node for node in _nodes(claimable) if node.get("Relation Name") == "story_jobs"]
    if not scans:
        return "(no scan of story_jobs found in the plan)"
    scan = scans[0]
    removed = scan.get("Rows Removed by Filter", 0)
    statement = explaining.plan
    return (f"read {scan.get('Index Name') or scan['Relation Name']} ({scan['Node Type']}), "
            f"{removed:,} rows removed by filter, {scan['Actual Total Time']:.2f} ms; the whole statement "
            f"{explaining.execution_ms:.2f} ms, {statement.get('Shared Hit Blocks', 0):,} buffers hit, "
            f"{statement.get('Shared Read Blocks', 0):,} read")


class _Explained(Exception):
    """The plan is captured; the query function's own reading of rows is skipped."""


class _ExplainingConnection:
    """Runs the statement a query function sends as EXPLAIN (ANALYZE, FORMAT
    JSON), with the parameters it built, and keeps the plan."""

    def __init__(self, conn: store.Conn) -> None:
        self._conn = conn
        self.plan: dict[str, Any] | None = None
        self.execution_ms = 0.0

    async def execute(self, query: str, params: dict[str, Any] | None = None) -> None:
        cursor = await self._conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query, params)
        row = await cursor.fetchone()
        assert row is not None
        self.plan = row[0][0]["Plan"]
        self.execution_ms = row[0][0].get("Execution Time", 0.0)
        raise _Explained


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


async def _sweep_ms(databases: dict[str, BenchDatabase], result: BenchResult, sweeps: int) -> dict[str, float]:
    """Median time of a sweeper pass, per database, the databases taking
    turns pass by pass."""
    pools = {}
    try:
        for variant, bench_db in databases.items():
            pools[variant] = db.make_pool(bench_db.url, application_name="storyjobs-sweeper", connect_timeout_s=5,
                                          statement_timeout_s=60, min_size=1, max_size=1, wait_timeout_s=10)
            await pools[variant].open(wait=True)
        sweepers = {
            variant: Sweeper(SweeperSettings(database_url=databases[variant].url, metrics_port=0), PgSweeperStore(pool))
            for variant, pool in pools.items()
        }
        for sweeper in sweepers.values():
            await sweeper.sweep_once()  # warm-up: connection, plans, caches
        timings: dict[str, list[float]] = {variant: [] for variant in sweepers}
        for turn in range(sweeps):
            for variant in _turns(turn):
                started = time.perf_counter()
                swept = await sweepers[variant].sweep_once()
                timings[variant].append((time.perf_counter() - started) * 1000)
                if swept.reclaimed or swept.pruned:
                    result.note(f"a sweeper pass changed rows ({swept.reclaimed} reclaimed, "
                                f"{swept.pruned} pruned)")
    finally:
        for pool in pools.values():
            await pool.close()
    return {variant: statistics.median(measured) for variant, measured in timings.items()}
