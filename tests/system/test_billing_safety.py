"""Never bill twice, never strand a job: real processes killed, signalled and
cut off from their database, against the fake provider."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter
from typing import Any

import psycopg
import pytest

from tests.fakes.anthropic_server import FakeAnthropicServer, Plan
from tests.support.database import create_key_sync
from tests.support.postgres_server import database_refused
from tests.support.waiting import wait_until_sync
from tests.system.procs import System

pytestmark = pytest.mark.system

FAST_TIMINGS: dict[str, Any] = {
    "HEARTBEAT_INTERVAL_S": 0.5,
    "HEARTBEAT_TIMEOUT_S": 2,
    "SWEEPER_INTERVAL_S": 0.5,
    "JOB_TIMEOUT_S": 40,
    "PENDING_TIMEOUT_S": 300,
    "LLM_TIMEOUT_S": 30,
    "LLM_READ_TIMEOUT_S": 10,
    "WORKER_POLL_INTERVAL_S": 0.5,
}


def _llm(fake_llm: FakeAnthropicServer) -> dict[str, Any]:
    return {"ANTHROPIC_API_KEY": "test-key", "ANTHROPIC_BASE_URL": fake_llm.base_url, **FAST_TIMINGS}


def _enqueue_direct(database_url: str, prompts: list[str]) -> None:
    """Stores pending jobs as the api would (the api is not under test here)."""
    from tests.support.database import client_id_of, enqueue

    async def run() -> None:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            client = await client_id_of(conn)
            for prompt in prompts:
                await enqueue(conn, client, prompt)

    asyncio.run(run())


def _statuses(database_url: str) -> dict[str, int]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        return dict(conn.execute("SELECT status::text, count(*) FROM story_jobs GROUP BY 1").fetchall())


def _wait_all_finished(database_url: str, total: int, timeout: float) -> dict[str, int]:
    def finished() -> bool:
        statuses = _statuses(database_url)
        return statuses.get("completed", 0) + statuses.get("failed", 0) == total

    wait_until_sync(finished, timeout=timeout, what=f"all {total} jobs to finish", interval=0.2)
    return _statuses(database_url)


def _tag(n: int) -> str:
    # delimited, so that "#1#" never matches inside "#17#"
    return f"chaos story #{n}#"


def test_chaos_kills_never_bill_a_job_twice(
    system: System, fake_llm: FakeAnthropicServer, database_url: str, record_property: Any
) -> None:
    """4 workers, 48 jobs of 2-3 s streams, 15 % of requests answered 529, a random worker SIGKILLed
    and replaced every few seconds for 24 s: every job finishes, none is billed twice, every
    completed job exactly once, the ledger agrees with the provider's count, and no finished job
    keeps an unfinished ledger row."""
    rng = random.Random(7)
    fake_llm.fake.default = Plan(chunks=10, duration_s=2.5)
    fake_llm.fake.overload_rate = 0.15
    env = {**_llm(fake_llm), "WORKER_CONCURRENCY": 2, "LLM_RETRY_ATTEMPTS": 8}
    api = system.api(QUEUE_MAX=500)
    key = create_key_sync(database_url, "chaos")
    workers = [system.worker(**env) for _ in range(4)]
    system.sweeper(**FAST_TIMINGS)

    import httpx

    total = 48
    with httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as client:
        for n in range(total):
            answer = client.post("/stories/generate", json={"prompt": _tag(n)},
                                 headers={"Idempotency-Key": f"chaos-{n}"})
            assert answer.status_code == 202, answer.text
    kills = 0
    chaos_ends = time.monotonic() + 24
    while time.monotonic() < chaos_ends:
        time.sleep(rng.uniform(2.0, 4.0))
        victim = rng.choice([w for w in workers if w.popen.poll() is None])
        victim.kill()
        kills += 1
        workers.append(system.worker(wait=False, **env))
    statuses = _wait_all_finished(database_url, total, timeout=90)

    billed_per_job: Counter[int] = Counter()
    for call in fake_llm.fake.billed:
        for n in range(total):
            if _tag(n) in call.prompt:
                billed_per_job[n] += 1
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT j.request->>'prompt', j.status::text, "
            "       count(c.job_id) FILTER (WHERE c.billed), "
            "       count(c.job_id) FILTER (WHERE c.outcome = 'succeeded'), "
            "       array_remove(array_agg(c.request_id) FILTER (WHERE c.billed), NULL) "
            "FROM story_jobs j LEFT JOIN llm_calls c ON c.job_id = j.id GROUP BY j.id"
        ).fetchall()
        # the ledger invariant: no unfinished row for a finished job
        open_calls = conn.execute(
            "SELECT count(*) FROM llm_calls c JOIN story_jobs j ON j.id = c.job_id "
            "WHERE c.outcome = 'started' AND j.status IN ('completed', 'failed')").fetchone()
    by_tag = {prompt: (status, ledger_billed, succeeded, request_ids)
              for prompt, status, ledger_billed, succeeded, request_ids in rows}
    fake_request_ids = {call.request_id for call in fake_llm.fake.billed}
    for n in range(total):
        status, ledger_billed, succeeded, request_ids = by_tag[_tag(n)]
        assert billed_per_job[n] <= 1, f"job {n} billed {billed_per_job[n]} times"
        assert ledger_billed <= 1, f"job {n} has {ledger_billed} possibly-billed ledger rows"
        # the ledger never under-counts: a call it knows finished is the provider's, by request id
        assert billed_per_job[n] <= ledger_billed
        assert set(request_ids) <= fake_request_ids
        if status == "completed":
            assert billed_per_job[n] == 1 and succeeded == 1 and len(request_ids) == 1
    assert open_calls == (0,)
    completed = statuses.get("completed", 0)
    figures = {"jobs": total, "kills": kills, "completed": completed, "failed": statuses.get("failed", 0),
               "provider_requests": len(fake_llm.fake.calls), "billed": len(fake_llm.fake.billed),
               "billed_twice": sum(1 for v in billed_per_job.values() if v > 1)}
    for name, value in figures.items():
        record_property(name, value)
    # the run's figures, for whoever runs it with -s
    print("\nchaos: " + " ".join(f"{k}={v}" for k, v in figures.items()))  # noqa: T201
    assert kills >= 5
    assert completed >= total // 2  # kills fail at most the jobs in flight at each kill


def test_sigterm_finishes_the_job_in_flight_and_claims_nothing_new(
    system: System, fake_llm: FakeAnthropicServer, database_url: str
) -> None:
    """SIGTERM during a stream: the story completes, the process exits 0, and the job waiting
    behind it stays pending for another worker."""
    fake_llm.fake.default = Plan(chunks=10, duration_s=3)
    worker = system.worker(WORKER_CONCURRENCY=1, WORKER_SHUTDOWN_GRACE_S=30, **_llm(fake_llm))
    _enqueue_direct(database_url, ["first story"])
    fake_llm.fake.wait_for(lambda f: f.calls and f.calls[0].chunks_sent >= 1)
    _enqueue_direct(database_url, ["second story"])
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute("SELECT request->>'prompt', status::text, worker_id FROM story_jobs ORDER BY id").fetchall()
    assert rows[0][1] == "completed"
    assert rows[1][1:] == ("pending", None)
    assert len(fake_llm.fake.calls) == 1
    events = [e["event"] for e in worker.events()]
    assert events.index("worker.stopping") < events.index("job.completed")


def test_sigterm_past_the_grace_period_fails_the_job_and_closes_its_stream(
    system: System, fake_llm: FakeAnthropicServer, database_url: str
) -> None:
    """A job that cannot finish within WORKER_SHUTDOWN_GRACE_S is failed as interrupted by its own
    worker, its stream is closed, its partial usage recorded, and the process exits 0."""
    fake_llm.fake.default = Plan(chunks=100, duration_s=60)
    worker = system.worker(WORKER_SHUTDOWN_GRACE_S=1, **_llm(fake_llm))
    _enqueue_direct(database_url, ["a very long story"])
    fake_llm.fake.wait_for(lambda f: f.calls and f.calls[0].chunks_sent >= 2)
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=20) == 0
    fake_llm.fake.wait_for(lambda f: f.calls[0].closed_early, timeout=5)
    with psycopg.connect(database_url, autocommit=True) as conn:
        job = conn.execute("SELECT status::text, error_code FROM story_jobs").fetchone()
        call = conn.execute("SELECT outcome, billed, output_tokens > 0 FROM llm_calls").fetchone()
    assert job == ("failed", "interrupted")
    assert call == ("stopped", True, True)


def test_a_database_outage_fails_no_job_and_every_process_recovers(
    system: System, fake_llm: FakeAnthropicServer, database_url: str, server_url: str, database_name: str
) -> None:
    """Connections dropped and refused for longer than the heartbeat timeout: workers and sweeper
    live on, no job is failed as interrupted, and jobs enqueued before the outage complete after it."""
    fake_llm.fake.default = Plan(chunks=12, duration_s=4)
    workers = [system.worker(**_llm(fake_llm)) for _ in range(2)]
    sweeper = system.sweeper(**FAST_TIMINGS)
    _enqueue_direct(database_url, [f"outage story {n}" for n in range(4)])
    fake_llm.fake.wait_for(lambda f: len(f.calls) >= 2 and all(c.chunks_sent >= 1 for c in f.calls[:2]))
    with database_refused(server_url, database_name):
        time.sleep(5)  # the outage itself: longer than HEARTBEAT_TIMEOUT_S (2 s)
    statuses = _wait_all_finished(database_url, 4, timeout=60)
    assert statuses == {"completed": 4}
    assert all(proc.popen.poll() is None for proc in [*workers, sweeper])
    for worker in workers:
        tasks = {(e["event"], e.get("task")) for e in worker.events()}
        assert {("worker.database_error", "heartbeat"), ("worker.database_recovered", "heartbeat")} <= tasks
    assert any(e["event"] == "sweeper.database_error" for e in sweeper.events())
    assert not any(e["event"] == "sweeper.reclaimed" for e in sweeper.events())
    assert len(fake_llm.fake.billed) == 4
