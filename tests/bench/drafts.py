"""drafts: what the story as it is written costs, drafts on and off, and
what a poll costs whole, from a character, and revalidated.

The drain: JOBS jobs stream STREAM_S each (STREAM_CHUNKS chunks of
WORDS_PER_CHUNK words, about 4 kB a story) from the fake provider (its own
process), all at once (WORKERS worker processes × CONCURRENCY), once with
DRAFT_INTERVAL_S=1 and once with 0, in turns, each in a database of its
own. For each: the drain (the pending jobs inserted to the last one ended),
the workers' CPU (utime + stime of their processes) per job, the rows the
database wrote (inserted + updated + deleted, pg_stat_database of the
benchmark database) and its transactions per job, and the WAL per job as
the server's insert position moved. The server may be shared: its WAL
counts every database's writes, so a precise figure comes from the draft
statement itself: EXPLAIN (ANALYZE, WAL) of one draft write for JOBS
running jobs (a chunk of one interval each), its WAL bytes per job.

The poll: one running job whose draft holds a whole story (STREAM_CHUNKS
chunks), loaded at CONNECTIONS connections three ways, in short slices
taken in turns: the whole draft (since=0), only what is new (since=its
length: no text), and revalidated (If-None-Match with its ETag: 304). The
load generator shares the machine's cores with the api, so beside requests/s
each kind gets the api process's own CPU per request (utime + stime of its
process over the slices), which the generator's cost does not move.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx

from tests.bench.api_load import API_ENV
from tests.bench.harness import (
    BenchContext,
    BenchDatabase,
    BenchResult,
    DatabaseCounters,
    FigureSpec,
    cpu_seconds,
)
from tests.bench.loadgen import LoadResult, describe_tool, run_load
from tests.support import postgres_server
from tests.support.database import create_key_sync
from tests.system.procs import Proc
from worker.rows import DraftPiece

NAME = "drafts"
CONNECTIONS = 32
MODES = ("on", "off")
POLLS = ("full", "since", "not_modified")
SPECS: dict[str, FigureSpec] = {}
for _mode in MODES:
    SPECS[f"drain_s_{_mode}"] = FigureSpec(f"drain of the jobs, drafts {_mode}", "s")
    SPECS[f"worker_cpu_ms_per_job_{_mode}"] = FigureSpec(f"worker CPU per job, drafts {_mode}", "ms")
    SPECS[f"rows_written_per_job_{_mode}"] = FigureSpec(f"rows written per job, drafts {_mode}", "rows")
    SPECS[f"transactions_per_job_{_mode}"] = FigureSpec(f"transactions per job, drafts {_mode}", "xacts")
    SPECS[f"server_wal_kib_per_job_{_mode}"] = FigureSpec(
        f"server WAL per job (every database of the server), drafts {_mode}", "KiB")
SPECS["drain_cost_pct"] = FigureSpec("drain, drafts on against off", "%")
SPECS["draft_write_wal_bytes_per_job"] = FigureSpec("one draft write: WAL per job (EXPLAIN ANALYZE WAL)", "B")
SPECS["draft_write_ms"] = FigureSpec("one draft write for all the jobs: execution time", "ms")
for _poll in POLLS:
    SPECS[f"poll_{_poll}_rps"] = FigureSpec(f"poll of a running job, {_poll}, {CONNECTIONS} connections", "req/s")
    SPECS[f"poll_{_poll}_p99_ms"] = FigureSpec(f"poll of a running job, {_poll}, p99", "ms")
    SPECS[f"poll_{_poll}_errors"] = FigureSpec(f"poll of a running job, {_poll}, errors", "requests")
    SPECS[f"poll_{_poll}_api_cpu_us"] = FigureSpec(
        f"poll of a running job, {_poll}: the api process's CPU per request", "µs")
SPECS["not_modified_vs_full"] = FigureSpec("poll, If-None-Match against full: requests/s", "x")
SPECS["since_vs_full"] = FigureSpec("poll, since against full: requests/s", "x")


def sizes(quick: bool) -> dict[str, Any]:
    """The sizes of a run: the issue's (200 jobs of 30 s), or small ones."""
    if quick:
        return {"jobs": 40, "stream_s": 8.0, "chunks": 16, "words_per_chunk": 40, "workers": 2, "concurrency": 20}
    return {"jobs": 200, "stream_s": 30.0, "chunks": 60, "words_per_chunk": 10, "workers": 4, "concurrency": 50}


def run(ctx: BenchContext, result: BenchResult) -> None:
    size = sizes(ctx.quick)
    slices, slice_s = (2, 1.0) if ctx.quick else (4, 3.0)
    result.params.update({**size, "draft_interval_s": 1.0, "poll_connections": CONNECTIONS, "poll_slices": slices,
                          "poll_slice_s": slice_s, "load_generator": describe_tool()})
    for run_number in range(1, ctx.runs + 1):
        for mode in MODES if run_number % 2 else reversed(MODES):
            _drain_once(ctx, result, mode, **size)
        result.add("drain_cost_pct", (result.samples["drain_s_on"][-1] / result.samples["drain_s_off"][-1] - 1) * 100)
        _statement_once(ctx, result, jobs=size["jobs"], chars=size["words_per_chunk"] * 7 * size["chunks"]
                        // max(1, int(size["stream_s"])))
        _poll_once(ctx, result, chunks=size["chunks"], words_per_chunk=size["words_per_chunk"], slices=slices,
                   slice_s=slice_s)
        ctx.progress(f"drafts run {run_number}/{ctx.runs}: " + ", ".join(
            f"{key} {values[-1]:,.2f}" for key, values in result.samples.items()))


def _wal_lsn(server_url: str) -> int:
    """The server's WAL insert position, in bytes (every database's writes)."""
    with postgres_server.admin(server_url) as admin:
        row = admin.execute("SELECT pg_current_wal_insert_lsn() - '0/0'").fetchone()
    assert row is not None
    return int(row[0])


def _drain_once(ctx: BenchContext, result: BenchResult, mode: str, *, jobs: int, stream_s: float, chunks: int,
                words_per_chunk: int, workers: int, concurrency: int) -> None:
    with ctx.database(f"drafts_{mode}") as bench_db, ctx.processes(bench_db) as system:
        provider = Proc("fake-provider", "tests.bench.fake_provider",
                        {**system.env, "FAKE_PROVIDER_CHUNKS": str(chunks), "FAKE_PROVIDER_STREAM_S": str(stream_s),
                         "FAKE_PROVIDER_WORDS_PER_CHUNK": str(words_per_chunk)},
                        system.log_dir / "fake-provider.log")
        system.procs.append(provider)
        listening = provider.wait_for_event("fake_provider.listening")
        llm = {"ANTHROPIC_API_KEY": "test", "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{listening['port']}"}
        procs = [system.worker(wait=False, WORKER_CONCURRENCY=concurrency, WORKER_SHUTDOWN_GRACE_S=5,
                               DRAFT_INTERVAL_S=1 if mode == "on" else 0, **llm)
                 for _ in range(workers)]
        watched = [*procs, provider]
        bench_db.wait_workers_listening(watched, workers, timeout_s=120)
        time.sleep(1.0)
        client_id = bench_db.create_client()
        with DatabaseCounters(bench_db.server_url, bench_db.name) as counters:
            cpu_before = sum(cpu_seconds(proc.pid) or 0.0 for proc in procs)
            activity_before = counters.activity()
            wal_before = _wal_lsn(bench_db.server_url)
            started = time.monotonic()
            bench_db.insert_pending(client_id, jobs, notify=True)
            bench_db.wait_drained(watched, timeout_s=stream_s * 3 + 120)
            drained_s = time.monotonic() - started
            wal_after = _wal_lsn(bench_db.server_url)
            cpu_after = sum(cpu_seconds(proc.pid) or 0.0 for proc in procs)
            # the workers' backends publish their counters when they exit
            for proc in procs:
                proc.stop(timeout=30)
            activity_after = counters.activity()
        completed = bench_db.count_status("completed")
        if completed != jobs:
            result.note(f"drafts {mode}: only {completed} of {jobs} jobs completed in a run")
        left = bench_db.scalar("SELECT count(*) FROM story_draft_chunks")
        if left:
            result.note(f"drafts {mode}: {left} draft chunks left after the drain")
        result.add(f"drain_s_{mode}", drained_s)
        result.add(f"worker_cpu_ms_per_job_{mode}", (cpu_after - cpu_before) * 1000 / jobs)
        result.add(f"transactions_per_job_{mode}", (activity_after[0] - activity_before[0]) / jobs)
        result.add(f"rows_written_per_job_{mode}", (activity_after[1] - activity_before[1]) / jobs)
        result.add(f"server_wal_kib_per_job_{mode}", (wal_after - wal_before) / 1024 / jobs)


def _running_jobs(bench_db: BenchDatabase, jobs: int) -> list[int]:
    client_id = bench_db.create_client()
    bench_db.insert_pending(client_id, jobs)
    with bench_db.connect() as conn:
        rows = conn.execute(
            "UPDATE story_jobs SET status = 'running', started_at = now(), heartbeat_at = now(), worker_id = 'w1' "
            "WHERE status = 'pending' RETURNING id").fetchall()
    return sorted(int(row[0]) for row in rows)


def _statement_once(ctx: BenchContext, result: BenchResult, *, jobs: int, chars: int) -> None:
    """One draft write for ``jobs`` running jobs, each a chunk of ``chars``
    characters after one already written, under EXPLAIN (ANALYZE, WAL)."""
    from shared.queries import QUERIES

    with ctx.database("drafts_statement") as bench_db:
        ids = _running_jobs(bench_db, jobs)
        chunk = ("sleepy " * (chars // 7 + 1))[:chars]
        with bench_db.connect() as conn:
            def write(from_char: int) -> dict[str, Any]:
                pieces = [DraftPiece(job_id, from_char, chunk) for job_id in ids]
                row = conn.execute("EXPLAIN (ANALYZE, WAL, FORMAT JSON) " + QUERIES["draft_append"], {
                    "worker_id": "w1", "job_ids": [p.job_id for p in pieces],
                    "from_chars": [p.from_char for p in pieces], "texts": [p.text for p in pieces]}).fetchone()
                assert row is not None
                plan: dict[str, Any] = (row[0] if isinstance(row[0], list) else json.loads(row[0]))[0]
                return plan

            write(0)
            plan = write(chars)
        top = plan["Plan"]
        result.add("draft_write_wal_bytes_per_job", top.get("WAL Bytes", 0) / jobs)
        result.add("draft_write_ms", plan["Execution Time"])


def _poll_once(ctx: BenchContext, result: BenchResult, *, chunks: int, words_per_chunk: int, slices: int,
               slice_s: float) -> None:
    with ctx.database("drafts_poll") as bench_db:
        key = create_key_sync(bench_db.url, "bench")
        with ctx.processes(bench_db, **API_ENV) as system:
            api = system.api()
            answer = httpx.post(f"{api.base_url}/stories/generate", json={"prompt": "bench", "length": "short"},
                                headers={"Authorization": f"Bearer {key}", "Idempotency-Key": uuid.uuid4().hex})
            job_id = answer.json()["job_id"]
            with bench_db.connect() as conn:
                row = conn.execute(
                    "UPDATE story_jobs SET status = 'running', started_at = now(), heartbeat_at = now(), "
                    "worker_id = 'w1' WHERE public_id = %s RETURNING id", (job_id,)).fetchone()
                assert row is not None
                job = row[0]
                piece = "sleepy " * words_per_chunk
                conn.execute("INSERT INTO story_draft_chunks (job_id, from_char, chars, text) "
                             "SELECT %(job)s, (n - 1) * %(len)s, %(len)s, %(piece)s FROM generate_series(1, %(n)s) n",
                             {"job": job, "len": len(piece), "piece": piece, "n": chunks})
            url = f"{api.base_url}/stories/jobs/{job_id}"
            first = httpx.get(url, headers={"Authorization": f"Bearer {key}"})
            chars, etag = first.json()["draft"]["chars"], first.headers["etag"]
            result.note(f"poll: a draft of {chars} characters; the whole answer is {len(first.content):,} bytes")
            loads = {
                "full": (f"{url}?since=0", {}),
                "since": (f"{url}?since={chars}", {}),
                "not_modified": (f"{url}?since={chars}", {"If-None-Match": etag}),
            }

            def load(kind: str, duration_s: float) -> LoadResult:
                target, headers = loads[kind]
                return run_load(url=target, method="GET", token=key, connections=CONNECTIONS, duration_s=duration_s,
                                key_prefix=uuid.uuid4().hex[:12], work_dir=system.log_dir, headers=headers)

            for kind in POLLS:
                load(kind, 1.0)
            measured: dict[str, list[LoadResult]] = {kind: [] for kind in POLLS}
            api_cpu: dict[str, float] = dict.fromkeys(POLLS, 0.0)
            for n in range(slices):
                for kind in POLLS if n % 2 == 0 else tuple(reversed(POLLS)):
                    before = cpu_seconds(api.pid) or 0.0
                    measured[kind].append(load(kind, slice_s))
                    api_cpu[kind] += (cpu_seconds(api.pid) or 0.0) - before
            rps = {kind: sum(x.requests for x in runs) / sum(x.duration_s for x in runs)
                   for kind, runs in measured.items()}
            for kind, runs in measured.items():
                result.add(f"poll_{kind}_rps", rps[kind])
                result.add(f"poll_{kind}_p99_ms", max(x.p99_ms for x in runs))
                result.add(f"poll_{kind}_errors", sum(x.errors for x in runs))
                result.add(f"poll_{kind}_api_cpu_us", api_cpu[kind] / max(1, sum(x.requests for x in runs)) * 1e6)
            result.add("not_modified_vs_full", rps["not_modified"] / rps["full"])
            result.add("since_vs_full", rps["since"] / rps["full"])
