"""story_move: an existing database's stories moved under partitions (migration 029 and the sweeper's first
pass, sweeper/partitions.py) while they are read and written.

A database migrated up to migration 028 is loaded with the history part's finished jobs
(``STORY_MOVE_JOBS``, default 300,000; 30,000 with --quick) on the same private Postgres 15, its stories in
the one table as before partitions. Then, while one session reads a finished job's story as the poll does
and another writes a story as the settle does, each without pause: migration 029 (catalog changes only),
then the sweeper's first pass over the stories (bound stories_unranged, validate the bound, which reads the
table, add the first ranges). Figures: the time of each, and the reads' and writes' p99 and longest before
and during.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import psycopg

from shared import migrate
from sweeper.store import PgSweeperStore
from tests.bench import history
from tests.bench.harness import BenchContext, BenchResult, FigureSpec, percentile
from tests.support import postgres_server

NAME = "story_move"
SPECS: dict[str, FigureSpec] = {
    "load_s": FigureSpec("loading the finished jobs before migration 029", "s"),
    "stories_mb": FigureSpec("the stories' table with its TOAST and indexes", "MB"),
    "migrate_s": FigureSpec("migration 029", "s"),
    "first_pass_s": FigureSpec("the sweeper's first pass over the stories (bound, validate, first ranges)", "s"),
    **{f"{kind}_{stat}_{stretch}_ms": FigureSpec(f"a story {kind} ({'the poll' if kind == 'read' else 'the settle'}"
                                                 f"), {stat}, {stretch}", "ms")
       for kind in ("read", "write") for stretch in ("before", "during") for stat in ("p99", "max")},
}
BEFORE_S = 10.0


def run(ctx: BenchContext, result: BenchResult) -> None:
    jobs = int(os.environ.get("STORY_MOVE_JOBS", "30000" if ctx.quick else "300000"))
    result.params.update({"jobs": jobs, "before_s": BEFORE_S})
    with history._server(result) as server_url:
        for run_number in range(1, ctx.runs + 1):
            name = f"storyjobs_story_move_{os.getpid()}_{run_number}"
            try:
                url = asyncio.run(postgres_server.create_database_migrated_before(server_url, name,
                                                                                  "story_partitions"))
                started = time.monotonic()
                history._load(url, jobs, story_ranges=False)
                result.add("load_s", time.monotonic() - started)
                result.add("stories_mb", _stories_mb(url))
                for key, value in _move(url).items():
                    result.add(key, value)
                ctx.progress(f"story_move run {run_number}/{ctx.runs}: {jobs:,} jobs moved")
            finally:
                postgres_server.drop_database(server_url, name)


def _stories_mb(url: str) -> float:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT pg_total_relation_size('stories')").fetchone()
    assert row is not None
    return float(row[0]) / 1e6


def _move(url: str) -> dict[str, float]:
    stop = threading.Event()
    reads: list[tuple[float, float]] = []
    writes: list[tuple[float, float]] = []
    threads = [threading.Thread(target=_reader, args=(url, stop, reads)),
               threading.Thread(target=_writer, args=(url, stop, writes))]
    for thread in threads:
        thread.start()
    try:
        time.sleep(BEFORE_S)
        moving_from = time.monotonic()
        asyncio.run(_migrate(url))
        migrated_at = time.monotonic()
        asyncio.run(_first_pass(url))
        moved_at = time.monotonic()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    figures = {"migrate_s": migrated_at - moving_from, "first_pass_s": moved_at - migrated_at}
    for kind, timed in (("read", reads), ("write", writes)):
        for stretch, (since, until) in (("before", (0.0, moving_from)), ("during", (moving_from, moved_at))):
            values = [ms for at, ms in timed if since <= at <= until]
            figures[f"{kind}_p99_{stretch}_ms"] = percentile(values, 99)
            figures[f"{kind}_max_{stretch}_ms"] = max(values)
    return figures


async def _migrate(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate.migrate(conn)


async def _first_pass(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await PgSweeperStore(conn).keep_story_partitions(retention_s=30 * history.DAY)


def _reader(url: str, stop: threading.Event, timed: list[tuple[float, float]]) -> None:
    """A finished job's story by its job, as the poll reads it, one job after another."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT max(id) FROM story_jobs").fetchone()
        assert row is not None
        last_id = int(row[0])
        n = 0
        while not stop.is_set():
            n += 1
            started = time.perf_counter()
            conn.execute("SELECT s.title, length(s.body) FROM story_jobs j "
                         "LEFT JOIN stories s ON s.job_id = j.id AND s.id = j.story_id WHERE j.id = %s",
                         (1 + (n * 7919) % last_id,)).fetchall()
            timed.append((time.monotonic(), (time.perf_counter() - started) * 1000))


def _writer(url: str, stop: threading.Event, timed: list[tuple[float, float]]) -> None:
    """A story for a failed job (they have none), as the settle writes one, one job after another (written
    again from the first once every failed job has one)."""
    with psycopg.connect(url, autocommit=True) as conn:
        storyless = [row[0] for row in conn.execute("SELECT id FROM story_jobs WHERE status = 'failed' ORDER BY id")]
        n = 0
        while not stop.is_set():
            started = time.perf_counter()
            conn.execute("INSERT INTO stories (id, job_id, client_id, title, body, model, prompt_version, "
                         "input_tokens, output_tokens, cost_usd) "
                         "VALUES (gen_random_uuid(), %s, 1, 'The Owl', repeat('hoo ', 800), 'm', 'v1', 300, 900, "
                         "0.0051) ON CONFLICT (job_id) DO UPDATE SET title = excluded.title",
                         (storyless[n % len(storyless)],))
            timed.append((time.monotonic(), (time.perf_counter() - started) * 1000))
            n += 1
