"""The promise through the real processes, where a fault crosses them: a real
worker, the fake provider, and the database cutting the worker's
connections (``pg_terminate_backend``) or refusing them (``ALLOW_CONNECTIONS
false``). The fake provider's record of what it billed is the proof."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import psycopg
import pytest

from tests.fakes.anthropic_server import FakeAnthropicServer, Plan
from tests.support import postgres_server
from tests.support.database import create_key_sync, rows_sync
from tests.support.waiting import wait_until_sync
from tests.system.procs import System

pytestmark = pytest.mark.system

TIMINGS: dict[str, Any] = {
    "HEARTBEAT_INTERVAL_S": 1,
    "HEARTBEAT_TIMEOUT_S": 30,
    "JOB_TIMEOUT_S": 120,
    "LLM_TIMEOUT_S": 60,
    "LLM_READ_TIMEOUT_S": 15,
    "WORKER_POLL_INTERVAL_S": 0.5,
}


def _post(api_url: str, key: str, prompt: str) -> str:
    answer = httpx.post(f"{api_url}/stories/generate", json={"prompt": prompt, "length": "short"}, timeout=20,
                        headers={"Authorization": f"Bearer {key}", "Idempotency-Key": str(uuid.uuid4())})
    assert answer.status_code == 202, answer.text
    job_id: str = answer.json()["job_id"]
    return job_id


def _cut_connections(database_url: str, database_name: str) -> int:
    (cut,) = rows_sync(database_url, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                 "WHERE datname = %s AND pid <> pg_backend_pid()", database_name)
    return int(cut[0])


def test_an_end_the_database_refuses_is_kept_and_the_story_is_never_requested_again(
    system: System, fake_llm: FakeAnthropicServer, database_url: str, database_name: str,
) -> None:
    """The provider reports 3,000,000,000 output tokens and the database refuses the story and then any
    failure of the job; the worker keeps the job, its connections are cut, and no second request is
    sent; once the database takes the end, the job is failed with its one billed call, charged its
    max_tokens."""
    fake = fake_llm.fake
    fake.default = Plan(chunks=3, final_output_tokens=3_000_000_000)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE stories ADD CONSTRAINT test_refuse_story CHECK (body NOT LIKE '%sleepy%')")
        conn.execute("ALTER TABLE story_jobs ADD CONSTRAINT test_refuse_failure CHECK (status <> 'failed') "
                     "NOT VALID")
    api = system.api()
    key = create_key_sync(database_url, "promise")
    # two slots: the worker goes on claiming (and so adopting after a lost answer) while it holds the job
    worker = system.worker(ANTHROPIC_API_KEY="test", ANTHROPIC_BASE_URL=fake_llm.base_url, WORKER_CONCURRENCY=2,
                           **TIMINGS)
    job_id = _post(api.base_url, key, "a sleepy owl")
    worker.wait_for_event("job.completion_unstorable", timeout=30)
    # the failure that replaces the story is refused too, in both its forms: then the connections are cut
    worker.wait_for_event("job.end_refused", timeout=30)
    assert _cut_connections(database_url, database_name) >= 1
    worker.wait_for_event("worker.database_recovered", timeout=30)
    # the claim the cut broke is searched for by adoption, which must not take the held job: rounds
    # go on meanwhile (the poll is 0.5 s), and none may send a second request: two seconds of them
    time.sleep(2)
    assert len(fake.calls) == 1
    assert rows_sync(database_url, "SELECT status FROM story_jobs WHERE public_id = %s", job_id) == [("running",)]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE story_jobs DROP CONSTRAINT test_refuse_failure")
    wait_until_sync(lambda: rows_sync(database_url, "SELECT status FROM story_jobs WHERE public_id = %s", job_id)
                    == [("failed",)], what="the job's end to be written", timeout=60)
    assert len(fake.calls) == 1 and len(fake.billed) == 1
    ledger = rows_sync(database_url, "SELECT c.attempt, c.outcome, c.billed, c.output_tokens = j.max_tokens "
                                 "FROM llm_calls c JOIN story_jobs j ON j.id = c.job_id")
    assert ledger == [(1, "succeeded", True, True)]
    assert not any(e["event"] == "job.adopted" for e in worker.events())
    assert worker.popen.poll() is None


def test_a_database_outage_during_a_429s_wait_keeps_the_job_and_bills_once(
    system: System, fake_llm: FakeAnthropicServer, server_url: str, database_url: str, database_name: str,
) -> None:
    """A 429 with retry-after: 1, and the database refusing connections for 6 s meanwhile (longer than the
    pool waits for a connection): the job is not failed; it completes after the database is back, the
    429's row not billed, one request billed."""
    fake = fake_llm.fake
    fake.queue(Plan(status=429, headers=(("retry-after", "1"),)))
    fake.default = Plan(chunks=3)
    api = system.api()
    key = create_key_sync(database_url, "promise")
    worker = system.worker(ANTHROPIC_API_KEY="test", ANTHROPIC_BASE_URL=fake_llm.base_url, **TIMINGS)
    job_id = _post(api.base_url, key, "a moonlit lake")
    wait_until_sync(lambda: any(c.status == 429 for c in fake.calls), what="the 429", timeout=30)
    with postgres_server.database_refused(server_url, database_name):
        wait_until_sync(lambda: any(e["event"] == "worker.database_error" for e in worker.events()),
                        what="the worker to meet it", timeout=15)
        # the outage itself: the 429's retry-after passes while it lasts
        time.sleep(6)
    wait_until_sync(lambda: rows_sync(database_url, "SELECT status FROM story_jobs WHERE public_id = %s", job_id)
                    == [("completed",)], what="the job to complete", timeout=60)
    assert [c.status for c in fake.calls] == [429, 200] and len(fake.billed) == 1
    ledger = rows_sync(database_url, "SELECT attempt, outcome, billed FROM llm_calls ORDER BY attempt")
    assert ledger == [(1, "rate_limited", False), (2, "succeeded", True)]
    assert worker.popen.poll() is None
