"""Drafts through the real processes: a client that polls with `since` and
`If-None-Match` downloads the story once, as it is written, and a worker
SIGKILLed mid-stream leaves its job's draft until the sweeper's end deletes
it."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest

from tests.fakes.anthropic_server import FakeAnthropicServer, Plan
from tests.support.database import create_key_sync, rows_sync
from tests.support.waiting import wait_until_sync
from tests.system.procs import System

pytestmark = pytest.mark.system

TIMINGS: dict[str, Any] = {
    "HEARTBEAT_INTERVAL_S": 0.5,
    "HEARTBEAT_TIMEOUT_S": 2,
    "SWEEPER_INTERVAL_S": 0.3,
    "JOB_TIMEOUT_S": 60,
    "LLM_TIMEOUT_S": 40,
    "LLM_READ_TIMEOUT_S": 30,
    "WORKER_POLL_INTERVAL_S": 0.5,
    "DRAFT_INTERVAL_S": 0.2,
}
STORY = ("Title: The Owl Who Counted Stars\nOnce upon a time, in a quiet wood, a small owl sat on a branch and "
         "counted the stars, one by one, until her eyes closed all by themselves. Good night, little owl. The end.")


def _client(system: System, database_url: str) -> httpx.Client:
    api = system.api(DRAFT_INTERVAL_S=TIMINGS["DRAFT_INTERVAL_S"])
    key = create_key_sync(database_url, "drafts")
    return httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=20)


def _post(http: httpx.Client, prompt: str) -> str:
    answer = http.post("/stories/generate", json={"prompt": prompt}, headers={"Idempotency-Key": str(uuid.uuid4())})
    assert answer.status_code == 202, answer.text
    return str(answer.json()["job_id"])


def _drafts(database_url: str) -> int:
    ((chunks,),) = rows_sync(database_url, "SELECT count(*) FROM story_draft_chunks")
    return int(chunks)


def test_a_client_polling_from_its_last_character_gets_the_story_once_as_it_is_written(
    system: System, fake_llm: FakeAnthropicServer, database_url: str,
) -> None:
    """Polling every 0.1 s with since=chars and the last ETag, a client sees the draft grow over several polls,
    gets 304 while it did not, and what it put together is the streamed text so far (what streamed after the
    last draft write comes with the story); the story is its title line and text; no draft is left."""
    fake_llm.fake.default = Plan(chunks=12, duration_s=3, text=STORY)
    system.worker(ANTHROPIC_API_KEY="test", ANTHROPIC_BASE_URL=fake_llm.base_url, **TIMINGS)
    with _client(system, database_url) as http:
        job_id = _post(http, "an owl")
        text, etag, statuses, grew = "", "", [], 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            answer = http.get(f"/stories/jobs/{job_id}", params={"since": len(text)},
                              headers={"If-None-Match": etag} if etag else {})
            statuses.append(answer.status_code)
            time.sleep(0.1)
            if answer.status_code == 200:
                etag, job = answer.headers["etag"], answer.json()
                if job["status"] in ("completed", "failed"):
                    break
                if job["status"] == "pending":
                    continue
                if job["draft"]["text"]:
                    grew += 1
                text += job["draft"]["text"]
                assert job["draft"]["chars"] == len(text)
                assert int(answer.headers["retry-after"]) <= 1
    assert job["status"] == "completed"
    assert grew >= 3 and 304 in statuses
    assert STORY.startswith(text) and len(text) > len(STORY) // 2
    assert (job["story"]["title"], job["story"]["text"]) == ("The Owl Who Counted Stars", STORY.partition("\n")[2])
    assert job["draft"] is None and _drafts(database_url) == 0


def test_a_worker_killed_mid_stream_leaves_its_draft_until_the_sweeper_ends_the_job(
    system: System, fake_llm: FakeAnthropicServer, database_url: str,
) -> None:
    """SIGKILL a worker while its story streams: the poll still shows the draft it wrote, unchanged, until the
    sweeper fails the job as interrupted, whose end deletes the draft."""
    fake_llm.fake.default = Plan(chunks=40, duration_s=30, text=STORY)
    worker = system.worker(ANTHROPIC_API_KEY="test", ANTHROPIC_BASE_URL=fake_llm.base_url, **TIMINGS)
    with _client(system, database_url) as http:
        job_id = _post(http, "a doomed owl")
        wait_until_sync(lambda: (http.get(f"/stories/jobs/{job_id}").json()["draft"] or {}).get("chars", 0) > 0,
                        what="a draft", timeout=30)
        worker.kill()
        left = http.get(f"/stories/jobs/{job_id}").json()
        assert left["status"] == "running" and left["draft"]["text"]
        assert STORY.startswith(left["draft"]["text"])
        time.sleep(1)  # longer than five draft intervals: nothing more is written, nothing is deleted
        assert http.get(f"/stories/jobs/{job_id}").json()["draft"] == left["draft"]
        system.sweeper(**TIMINGS)
        wait_until_sync(lambda: http.get(f"/stories/jobs/{job_id}").json()["status"] == "failed",
                        what="the sweeper to fail the job", timeout=30)
        ended = http.get(f"/stories/jobs/{job_id}").json()
    assert ended["error"]["code"] == "interrupted" and ended["draft"] is None
    assert _drafts(database_url) == 0
