"""The whole lifecycle with real processes: api, workers and sweeper on one Postgres."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import psycopg
import pytest

from tests.fakes.anthropic_server import FakeAnthropicServer, Plan
from tests.support.database import create_key_sync
from tests.support.waiting import wait_until_sync
from tests.system.procs import System

pytestmark = pytest.mark.system


def test_hundred_jobs_complete_with_one_provider_request_each(
    system: System, fake_llm: FakeAnthropicServer, database_url: str
) -> None:
    """api + 3 workers + sweeper as processes, the SDK pointed at the fake provider: 100 jobs
    enqueued over HTTP all complete, each with exactly one request to the provider."""
    fake_llm.fake.default = Plan(chunks=4, duration_s=0.05)
    key = create_key_sync(database_url, "system")
    llm: dict[str, Any] = {"ANTHROPIC_API_KEY": "test-key", "ANTHROPIC_BASE_URL": fake_llm.base_url}
    api = system.api(QUEUE_MAX=200)
    for _ in range(3):
        system.worker(WORKER_CONCURRENCY=4, **llm)
    system.sweeper()

    async def enqueue_all() -> list[str]:
        async with httpx.AsyncClient(base_url=api.base_url, timeout=10,
                                     headers={"Authorization": f"Bearer {key}"}) as client:
            answers = await asyncio.gather(*(
                client.post("/stories/generate", json={"prompt": f"story number {n}"},
                            headers={"Idempotency-Key": str(uuid.uuid4())})
                for n in range(100)))
        assert {a.status_code for a in answers} == {202}
        return [a.json()["job_id"] for a in answers]

    job_ids = asyncio.run(enqueue_all())
    with psycopg.connect(database_url, autocommit=True) as conn:
        wait_until_sync(lambda: conn.execute("SELECT count(*) FROM story_jobs WHERE status = 'completed'")
                        .fetchone() == (100,), timeout=60, interval=0.2, what="the 100 jobs to complete")
        statuses: dict[str, int] = dict(conn.execute("SELECT status::text, count(*) FROM story_jobs GROUP BY 1").fetchall())
        assert statuses == {"completed": 100}
        ledger = conn.execute(
            "SELECT count(*), count(DISTINCT job_id), count(DISTINCT request_id) FROM llm_calls WHERE billed"
        ).fetchone()
    assert ledger == (100, 100, 100)
    # the provider's own count: one billed request per job, never two
    assert len(fake_llm.fake.billed) == 100
    per_prompt: dict[str, int] = {}
    for call in fake_llm.fake.billed:
        per_prompt[call.prompt] = per_prompt.get(call.prompt, 0) + 1
    assert len(per_prompt) == 100 and set(per_prompt.values()) == {1}
    with httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {key}"}) as client:
        answer = client.get(f"/stories/jobs/{job_ids[0]}").json()
    assert answer["status"] == "completed" and answer["story"]["title"] == "A Fake Story"
