"""The real processes behind a real PgBouncer in transaction pooling, with a
small pool: the api, the workers and the sweeper reach the database through
it (DATABASE_POOLER=transaction), the workers' LISTEN and the migrations go
direct (DATABASE_LISTEN_URL)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql

from tests.fakes.anthropic_server import FakeAnthropicServer, Plan
from tests.support import postgres_server
from tests.support.database import create_key_sync
from tests.support.pgbouncer import PgBouncer
from tests.support.waiting import wait_until
from tests.system.procs import REPO, Proc, System, wait_while_running

pytestmark = pytest.mark.system

TIMINGS = {"HEARTBEAT_INTERVAL_S": 0.5, "HEARTBEAT_TIMEOUT_S": 5, "SWEEPER_INTERVAL_S": 0.5,
           "JOB_TIMEOUT_S": 120, "LLM_TIMEOUT_S": 60, "LLM_READ_TIMEOUT_S": 30, "PENDING_TIMEOUT_S": 600}
# far longer than the test: a job picked up in time was woken by a NOTIFY
POLL_S = 300
# other databases on the server are other tests'
THIS_DATABASES_ADVISORY_LOCKS = ("locktype = 'advisory' AND "
                                 "database = (SELECT oid FROM pg_database WHERE datname = current_database())")


def _scalar(database_url: str, query: str, *params: Any) -> Any:
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def _wait(check: Callable[[], bool], what: str, procs: list[Proc], timeout_s: float = 60.0) -> None:
    wait_while_running(check, procs, what=what, timeout=timeout_s)


def _errors(procs: list[Proc]) -> list[dict[str, Any]]:
    """Log lines at warning or above that say something went wrong with the database or a request."""
    return [event for proc in procs for event in proc.events()
            if event.get("level") in ("warning", "error", "critical")
            and ("database" in str(event.get("event")) or event.get("event") == "api.unhandled_error")]


def test_api_workers_and_sweeper_behind_pgbouncer_keep_every_guarantee(
    system: System, pgbouncer_factory: Callable[..., PgBouncer], database_name: str, database_url: str,
    fake_llm: FakeAnthropicServer,
) -> None:
    """Behind PgBouncer with 3 server connections: a burst of POSTs never exceeds QUEUE_MAX and one key makes one
    job, idle workers are woken by NOTIFY long before their poll, a DELETE stops a running stream, and 100 jobs
    all complete with one billed request each; no answer is a 5xx and no process meets a database error."""
    bouncer = pgbouncer_factory(default_pool_size=3)
    pooled: dict[str, Any] = {"DATABASE_URL": bouncer.url(database_name), "DATABASE_POOLER": "transaction",
              "DATABASE_LISTEN_URL": database_url, **TIMINGS}
    llm: dict[str, Any] = {"ANTHROPIC_API_KEY": "test-key", "ANTHROPIC_BASE_URL": fake_llm.base_url}
    fake_llm.fake.default = Plan(chunks=4, duration_s=0.2)
    key = create_key_sync(database_url, "pooled")
    api = system.api(QUEUE_MAX=20, API_POOL_SIZE=4, **pooled)
    sweeper = system.sweeper(**pooled)
    answers: list[httpx.Response] = []

    async def post(client: httpx.AsyncClient, prompt: str, idempotency_key: str) -> httpx.Response:
        answer = await client.post("/stories/generate", json={"prompt": prompt},
                                   headers={"Idempotency-Key": idempotency_key})
        answers.append(answer)
        return answer

    def client() -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=api.base_url, timeout=15, headers={"Authorization": f"Bearer {key}"})

    async def burst() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with client() as c:
            same = await asyncio.gather(*(post(c, "the same story", "same") for _ in range(20)))
            distinct = await asyncio.gather(*(post(c, f"burst {n}", str(uuid.uuid4())) for n in range(60)))
        return same, distinct

    # no worker yet: the queue only fills
    same, distinct = asyncio.run(burst())
    assert {a.status_code for a in same} == {202} and len({a.json()["job_id"] for a in same}) == 1
    statuses = [a.status_code for a in distinct]
    assert statuses.count(202) == 19 and statuses.count(429) == 41, statuses
    assert _scalar(database_url, "SELECT count(*) FROM story_jobs WHERE status = 'pending'") == 20

    workers = [system.worker(WORKER_CONCURRENCY=4, WORKER_POLL_INTERVAL_S=POLL_S, **pooled, **llm)
               for _ in range(3)]
    procs = [api, sweeper, *workers]
    _wait(lambda: _scalar(database_url, "SELECT count(*) FROM story_jobs WHERE status = 'completed'") == 20,
          "the first 20 jobs", procs)
    _wait(lambda: _scalar(database_url, "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                                        "AND application_name = 'storyjobs-worker-listen'", database_name) == 3,
          "3 workers to listen", procs)

    async def one_at_a_time(count: int) -> list[str]:
        async with client() as c:
            ids = []
            for n in range(count):
                answer = await post(c, f"woken {n}", str(uuid.uuid4()))
                ids.append(answer.json()["job_id"])
                url = f"/stories/jobs/{ids[-1]}"

                async def completed(url: str = url) -> bool:
                    return bool((await c.get(url)).json()["status"] == "completed")

                await wait_until(completed, interval=0.05, what=f"job {ids[-1]} to complete")
        return ids

    # idle workers: each job is claimed at its NOTIFY, the poll being minutes away
    woken = asyncio.run(one_at_a_time(5))
    waits = [_scalar(database_url, "SELECT extract(epoch FROM started_at - created_at)::float8 FROM story_jobs "
                                   "WHERE public_id = %s", job_id) for job_id in woken]
    # woken, not polled: the poll is five minutes away
    assert max(waits) < 10.0, waits

    # a running job cancelled through the pooler: its worker closes the stream at its next heartbeat
    fake_llm.fake.queue_for("cancel me", Plan(chunks=200, duration_s=60))

    async def cancel() -> tuple[int, int]:
        async with client() as c:
            job_id = (await post(c, "cancel me", str(uuid.uuid4()))).json()["job_id"]

            async def running() -> bool:
                return bool((await c.get(f"/stories/jobs/{job_id}")).json()["status"] == "running")

            await wait_until(running, interval=0.05, what="the job to run")
            # running is written at the claim, before the request is sent:
            # cancelled before that, nothing would reach the fake to be closed
            await asyncio.to_thread(fake_llm.fake.wait_for, lambda f: any(
                "cancel me" in c.prompt and c.chunks_sent >= 1 for c in f.calls), 30)
            first, second = await c.delete(f"/stories/jobs/{job_id}"), await c.delete(f"/stories/jobs/{job_id}")
        return first.status_code, second.status_code

    assert asyncio.run(cancel()) == (200, 409)
    # (wait_for holds the fake's lock: the predicate reads its calls directly)
    fake_llm.fake.wait_for(lambda f: any(c.closed_early and "cancel me" in c.prompt for c in f.calls), timeout=10)

    async def the_rest(count: int) -> None:
        async with client() as c:
            async def until_accepted(n: int) -> None:
                idempotency_key = str(uuid.uuid4())

                async def accepted() -> bool:
                    return (await post(c, f"story {n}", idempotency_key)).status_code != 429

                await wait_until(accepted, timeout=180, interval=0.2, what=f"story {n} to be accepted")

            await asyncio.gather(*(until_accepted(n) for n in range(count)))

    asyncio.run(the_rest(75))
    _wait(lambda: _scalar(database_url, "SELECT count(*) FROM story_jobs WHERE status IN ('pending', 'running')")
          == 0, "every job to finish", procs)
    with psycopg.connect(database_url, autocommit=True) as conn:
        by_status: dict[str, int] = dict(conn.execute("SELECT status::text, count(*) FROM story_jobs GROUP BY 1").fetchall())
        ledger = conn.execute("SELECT count(*), count(DISTINCT job_id) FROM llm_calls WHERE billed").fetchone()
        locks = conn.execute(f"SELECT count(*) FROM pg_locks WHERE {THIS_DATABASES_ADVISORY_LOCKS}").fetchone()
    assert by_status == {"completed": 100, "failed": 1}
    assert ledger == (101, 101)
    assert len(fake_llm.fake.billed) == 101
    assert locks == (0,)
    assert not [a for a in answers if a.status_code >= 500]
    assert not _errors(procs), _errors(procs)
    pool = bouncer.pool(database_name)  # one read: two would race a connection between idle and active
    assert int(pool["sv_active"]) + int(pool["sv_idle"]) <= 3, pool


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={"PATH": "", **env}, timeout=60)


@pytest.fixture
def empty_database(server_url: str) -> Iterator[str]:
    """A database with nothing in it, dropped at the end."""
    name = f"storyjobs_empty_{uuid.uuid4().hex[:12]}"
    with postgres_server.admin(server_url) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield name
    postgres_server.drop_database(server_url, name)


def test_migrate_behind_a_pooler_runs_on_the_listen_url_and_refuses_without_one(
    pgbouncer: PgBouncer, server_url: str, empty_database: str
) -> None:
    """storyjobs migrate with DATABASE_POOLER=transaction exits with one line naming DATABASE_LISTEN_URL when it is
    unset (its advisory lock needs a session), and migrates over it when set, leaving no lock behind."""
    direct = postgres_server.with_dbname(server_url, empty_database)
    env = {"DATABASE_URL": pgbouncer.url(empty_database), "DATABASE_POOLER": "transaction"}
    refused = _cli(env, "migrate")
    assert refused.returncode == 2
    assert len(refused.stderr.strip().splitlines()) == 1 and "DATABASE_LISTEN_URL" in refused.stderr
    done = _cli({**env, "DATABASE_LISTEN_URL": direct}, "migrate")
    assert done.returncode == 0, done.stderr
    assert "applied 001_" in done.stdout
    assert _scalar(direct, f"SELECT count(*) FROM pg_locks WHERE {THIS_DATABASES_ADVISORY_LOCKS}") == 0
    # the other commands go through the pooler
    listed = _cli(env, "jobs", "list")
    assert listed.returncode == 0, listed.stderr
