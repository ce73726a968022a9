"""One run of the real processes through the faults real deployments meet: the
database turns read-only while stories stream, the provider sends text
Postgres cannot store, a client cancels during a retry wait, a worker is
killed mid-stream and its job then cancelled, and a 429 says not to retry."""

from __future__ import annotations

import signal
import time
import uuid
from collections import Counter
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql

from tests.fakes.anthropic_server import FakeAnthropicServer, Plan
from tests.support.database import create_key_sync, rows_sync
from tests.support.waiting import wait_until_sync
from tests.system.procs import Proc, System

pytestmark = pytest.mark.system

TIMINGS: dict[str, Any] = {
    "HEARTBEAT_INTERVAL_S": 1,
    "HEARTBEAT_TIMEOUT_S": 3,
    "SWEEPER_INTERVAL_S": 0.5,
    "JOB_TIMEOUT_S": 60,
    "PENDING_TIMEOUT_S": 300,
    "LLM_TIMEOUT_S": 40,
    "LLM_READ_TIMEOUT_S": 15,
    "WORKER_POLL_INTERVAL_S": 0.5,
}


def _read_only(server_url: str, database_name: str, on: bool) -> None:
    """Turns the database read-only (or back) for every session: new sessions
    read the setting, so the current ones are cut, as in a failover."""
    with psycopg.connect(server_url, autocommit=True) as admin:
        name = sql.Identifier(database_name)
        if on:
            admin.execute(sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(name))
        else:
            admin.execute(sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(name))
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                      "AND pid <> pg_backend_pid()", (database_name,))


def test_every_fault_in_one_run_leaves_every_process_alive_and_nothing_billed_twice(
    system: System, fake_llm: FakeAnthropicServer, database_url: str, database_name: str, server_url: str,
) -> None:
    """Read-only for longer than HEARTBEAT_TIMEOUT_S while four stories stream, a story holding U+0000, a
    cancel during a 429's retry wait, a worker SIGKILLed mid-stream whose job is then cancelled, and a 429
    with x-should-retry: false. Afterwards every process but the killed worker is alive, the streamed
    jobs completed, no request was billed after a cancel, the do-not-retry job sent one request, no
    finished job has an open ledger row, and nothing was billed twice."""
    fake = fake_llm.fake
    fake.default = Plan(chunks=10, duration_s=4)
    llm: dict[str, Any] = {"ANTHROPIC_API_KEY": "test", "ANTHROPIC_BASE_URL": fake_llm.base_url, **TIMINGS}
    api = system.api(QUEUE_MAX=100)
    key = create_key_sync(database_url, "faults")
    workers = [system.worker(WORKER_CONCURRENCY=2, **llm) for _ in range(3)]
    sweeper = system.sweeper(**TIMINGS)
    http = httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=20)

    def post(prompt: str) -> str:
        # as a client does: a 503 (a pooled connection cut by the fault) is retried with the same key
        headers = {"Idempotency-Key": str(uuid.uuid4())}
        for _ in range(5):
            answer = http.post("/stories/generate", json={"prompt": prompt}, headers=headers)
            if answer.status_code != 503:
                break
        assert answer.status_code == 202, answer.text
        job_id: str = answer.json()["job_id"]
        return job_id

    def cancel(job_id: str) -> None:
        answer = http.delete(f"/stories/jobs/{job_id}")
        assert answer.status_code == 200, answer.text

    with http:
        # 1. read-only for 5 s (HEARTBEAT_TIMEOUT_S is 3) while four stories stream
        streamed = [post(f"read-only story {n}") for n in range(4)]
        wait_until_sync(lambda: sum(1 for c in fake.calls if c.chunks_sent >= 1) >= 4, what="four stories to stream", timeout=30)
        _read_only(server_url, database_name, on=True)
        time.sleep(5)  # the fault itself, not a wait for a state
        _read_only(server_url, database_name, on=False)

        # 2. a story holding NUL, in its title and its text
        fake.queue_for("nul story", Plan(chunks=2, text="Title: The Owl\x00 Who Hooted\nOnce\x00 upon a time."))
        nul = post("nul story")

        # 3. a cancel while a 429's retry-after is waited out: 3 s, so the cancel
        # lands within it on a slow machine too; the retry's own check or the
        # heartbeat's report then stops the job, and no second request is sent either way
        # (tests/integration/test_faults.py takes the retry's check alone)
        fake.queue_for("story cancelled in a retry wait", Plan(status=429, retry_after_ms=3000))
        retried = post("story cancelled in a retry wait")
        wait_until_sync(lambda: any(c.status == 429 for c in fake.calls_for("story cancelled in a retry wait")), what="the 429", timeout=30)
        cancel(retried)

        # 4. a worker killed mid-stream, then its job cancelled
        fake.queue_for("killed story", Plan(chunks=40, duration_s=20))
        killed = post("killed story")
        wait_until_sync(lambda: any(c.chunks_sent >= 1 for c in fake.calls_for("killed story")), what="the doomed stream", timeout=30)
        ((worker_id,),) = rows_sync(database_url, "SELECT worker_id FROM story_jobs WHERE public_id = %s", killed)
        victim = next(w for w in workers if f"-{w.pid}-" in worker_id)
        victim.kill()
        cancel(killed)

        # 5. a 429 that says not to retry
        fake.queue_for("story told not to retry", Plan(status=429, retry_after_ms=10, should_retry=False))
        no_retry = post("story told not to retry")

        everyone = [*streamed, nul, retried, killed, no_retry]
        wait_until_sync(lambda: _all_finished(database_url, everyone), what="every job to finish", timeout=90)
        status = {job_id: http.get(f"/stories/jobs/{job_id}").json() for job_id in everyone}

    alive: list[Proc] = [api, sweeper, *(w for w in workers if w is not victim)]
    assert all(proc.popen.poll() is None for proc in alive)
    assert [status[j]["status"] for j in streamed] == ["completed"] * 4
    assert status[nul]["status"] == "completed"
    assert (status[nul]["story"]["title"], status[nul]["story"]["text"]) == ("The Owl Who Hooted", "Once upon a time.")
    assert (status[retried]["status"], status[retried]["error"]["code"]) == ("failed", "cancelled")
    assert [c.status for c in fake.calls_for("story cancelled in a retry wait")] == [429]
    assert (status[killed]["error"]["code"], len(fake.calls_for("killed story"))) == ("cancelled", 1)
    assert (status[no_retry]["status"], status[no_retry]["error"]["code"]) == ("failed", "llm_rejected")
    assert len(fake.calls_for("story told not to retry")) == 1
    open_rows = rows_sync(database_url, "SELECT count(*) FROM llm_calls c JOIN story_jobs j ON j.id = c.job_id "
                                    "WHERE c.outcome = 'started' AND j.status IN ('completed', 'failed')")
    assert open_rows == [(0,)]
    billed = Counter(call.prompt for call in fake.billed)
    assert billed and max(billed.values()) == 1
    assert not any(e["event"] == "sweeper.reclaimed" for e in sweeper.events())
    # the workers met the read-only database itself, not only cut connections
    assert any(e["event"] == "worker.database_error" and e.get("sqlstate") == "25006"
               for worker in workers for e in worker.events())
    assert victim.popen.returncode == -signal.SIGKILL


def _all_finished(database_url: str, job_ids: list[str]) -> bool:
    rows = rows_sync(database_url, "SELECT count(*) FROM story_jobs WHERE public_id = ANY(%s::uuid[]) "
                               "AND status IN ('completed', 'failed')", job_ids)
    return bool(rows[0][0] == len(job_ids))
