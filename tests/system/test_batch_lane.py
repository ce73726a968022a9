"""The batch lane with the real processes (the api and workers as
tests/system/procs.py starts them): three stories through one message batch
of the offline batch writer (no provider key, as `make run` has it), and,
through the real anthropic SDK against the fake provider, a worker killed
with SIGKILL once its batch was created: the submitter lease runs out, a
second worker takes it and collects, and the provider billed each request
once."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest

from tests.fakes.anthropic_server import FakeAnthropicServer
from tests.support import ops_seed as seed
from tests.support.database import create_key_sync
from tests.system.procs import Proc, System, wait_while_running

pytestmark = pytest.mark.system

PROMPTS = ("a whale who hums the tide to sleep", "a lighthouse that counts ships", "a fox who sews with moonlight")


def rows(database_url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


def ask(client: httpx.Client, prompt: str) -> httpx.Response:
    return client.post("/stories/generate", json={"prompt": prompt, "length": "short", "lane": "batch"},
                       headers={"Idempotency-Key": str(uuid.uuid4())})


def poll_until_ended(client: httpx.Client, location: str, procs: list[Proc], *, timeout: float) -> list[dict[str, Any]]:
    """Every answer of the job's poll until it completed or failed."""
    answers: list[dict[str, Any]] = []

    def ended() -> bool:
        answer = client.get(location)
        assert answer.status_code == 200, answer.text
        answers.append({**answer.json(), "retry_after": answer.headers.get("retry-after")})
        return answers[-1]["status"] in ("completed", "failed")

    wait_while_running(ended, procs, what=f"{location} to end", timeout=timeout, interval=0.5)
    return answers


def test_three_batch_stories_go_through_one_offline_batch_and_complete_with_their_ledger_closed(
    system: System, database_url: str,
) -> None:
    """Without a provider key, three stories asked with "lane": "batch" are accepted with their lane and a
    due_by a collection and a day after their admission, go into one message batch of the offline batch writer,
    and complete; every poll says the lane, a live one its due_by and a Retry-After of at least
    BATCH_POLL_INTERVAL_S; the console lists the one batch, ended, three succeeded; each job's ledger row is
    closed, billed at nothing."""
    key = create_key_sync(database_url, "parent")
    operator = seed.seeded(database_url, seed.operator_key)
    lane: dict[str, Any] = {"BATCH_COLLECT_S": 3, "BATCH_POLL_INTERVAL_S": 1, "OFFLINE_DELAY_S": 1}
    api = system.api(**lane)
    worker = system.worker(**lane)
    started = worker.wait_for_event("batch.lane_started")
    assert started["provider"] == "offline"

    with httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {key}"}) as client:
        accepted = [ask(client, prompt) for prompt in PROMPTS]
        for answer in accepted:
            assert answer.status_code == 202, answer.text
            assert answer.json()["lane"] == "batch" and int(answer.headers["retry-after"]) >= 1
        created = dict(rows(database_url, "SELECT public_id::text, created_at FROM story_jobs"))
        for answer in accepted:
            job = answer.json()
            due_by = datetime.fromisoformat(job["due_by"])
            assert due_by == created[job["job_id"]] + timedelta(seconds=3, hours=24)
        polls = [poll_until_ended(client, answer.headers["location"], [api, worker], timeout=90)
                 for answer in accepted]
    for answers in polls:
        assert [a["status"] for a in answers][-1] == "completed"
        assert all(a["lane"] == "batch" for a in answers)
        assert answers[-1]["story"]["title"] and answers[-1]["due_by"] is None
        for live in (a for a in answers if a["status"] in ("pending", "running")):
            assert live["due_by"] is not None and int(live["retry_after"]) >= 1

    # one batch for the three, as the console shows it
    with httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {operator}"}) as console:
        [batch] = console.get("/ops/api/batches").json()["batches"]
    assert (batch["state"], batch["request_count"], batch["counts"]["succeeded"]) == ("ended", 3, 3)
    assert batch["provider_batch_id"].startswith("offlinebatch_") and batch["cost_usd"] == "0.000000"
    assert rows(database_url, "SELECT DISTINCT batch_id FROM story_jobs") == [(batch["id"],)]
    ledger = rows(database_url, "SELECT attempt, provider, outcome, billed, finished_at IS NOT NULL, cost_usd, "
                                "batch_id FROM llm_calls ORDER BY job_id")
    assert [row[:5] for row in ledger] == [(1, "offline", "succeeded", True, True)] * 3
    assert {(row[5], row[6]) for row in ledger} == {(0, batch["id"])}
    assert rows(database_url, "SELECT count(*) FROM stories") == [(3,)]


def test_a_worker_killed_with_its_batch_in_flight_loses_nothing_and_the_next_holder_collects_it(
    system: System, fake_llm: FakeAnthropicServer, database_url: str,
) -> None:
    """Through the real SDK against the fake provider: the worker holding the submitter lease creates the batch
    and is killed with SIGKILL before the batch ends; a second worker takes the lease once it runs out
    (BATCH_CREATE_TIMEOUT_S keeps it short), collects the batch when it ends, and every story completes: one
    create, each request billed once, each ledger row closed billed at the batch price."""
    fake = fake_llm.fake.batches
    key = create_key_sync(database_url, "parent")
    lane: dict[str, Any] = {"BATCH_COLLECT_S": 1, "BATCH_POLL_INTERVAL_S": 1, "BATCH_CREATE_TIMEOUT_S": 2}
    llm: dict[str, Any] = {"ANTHROPIC_API_KEY": "test", "ANTHROPIC_BASE_URL": fake_llm.base_url}
    api = system.api(**lane)
    first = system.worker(**llm, **lane)
    first_holder = first.wait_for_event("batch.lane_started")["holder"]

    with httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {key}"}) as client:
        accepted = [ask(client, prompt) for prompt in PROMPTS]
        assert [answer.status_code for answer in accepted] == [202] * 3

        def sent() -> bool:
            return rows(database_url, "SELECT state FROM message_batches") == [("sent",)]

        wait_while_running(sent, [api, first], what="the batch to be created", timeout=60)
        first.kill()
        [(provider_id,)] = rows(database_url, "SELECT provider_batch_id FROM message_batches")
        assert rows(database_url, "SELECT holder FROM batch_leases") == [(first_holder,)]
        assert fake.batch(provider_id).processing_status == "in_progress"
        assert rows(database_url, "SELECT DISTINCT status::text FROM story_jobs") == [("running",)]

        second = system.worker(**llm, **lane)
        second_holder = second.wait_for_event("batch.lane_started")["holder"]

        def taken() -> bool:
            return rows(database_url, "SELECT holder FROM batch_leases") == [(second_holder,)]

        # the lease lasts 2 × BATCH_CREATE_TIMEOUT_S and a margin of 30 s after the first holder's last tick
        wait_while_running(taken, [api, second], what="the second worker to take the lease", timeout=90)
        fake.end_batch(provider_id)
        for answer in accepted:
            answers = poll_until_ended(client, answer.headers["location"], [api, second], timeout=60)
            assert answers[-1]["status"] == "completed", answers[-1]

    assert len(fake.creates) == 1 and [batch.id for batch in fake.batches] == [provider_id]
    custom_ids = {custom_id for (custom_id,) in rows(database_url, "SELECT custom_id FROM message_batch_items")}
    assert fake.bills_by_custom_id() == dict.fromkeys(custom_ids, 1) and len(custom_ids) == 3
    ledger = rows(database_url, "SELECT c.worker_id, c.outcome, c.billed, c.finished_at IS NOT NULL, c.cost_usd, "
                                "j.charged_usd FROM llm_calls c JOIN story_jobs j ON j.id = c.job_id")
    assert len(ledger) == 3
    for worker_id, outcome, billed, finished, cost, charged in ledger:
        # the first holder wrote each row with the intent; the second closed it
        assert (worker_id, outcome, billed, finished) == (first_holder, "succeeded", True, True)
        assert cost == charged and cost > 0
    assert rows(database_url, "SELECT state FROM message_batches") == [("ended",)]
    assert any(event["event"] == "batch.results_read" for event in second.events())
