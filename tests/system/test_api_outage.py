"""A real api process through a database outage: connections cut and refused,
then allowed again."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import psycopg
import pytest

from tests.support.database import create_key_sync
from tests.support.postgres_server import database_refused
from tests.support.waiting import wait_until_sync
from tests.system.procs import System

pytestmark = pytest.mark.system

# "within a few seconds": API_DB_WAIT_S (3) plus room for a loaded machine
ANSWER_WITHIN_S = 8.0


def _timed(client: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    started = time.monotonic()
    answer = client.request(method, path, **kwargs)
    elapsed = time.monotonic() - started
    assert elapsed < ANSWER_WITHIN_S, f"{method} {path} took {elapsed:.1f} s"
    return answer


def _assert_unavailable(answer: httpx.Response) -> None:
    assert answer.status_code == 503, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert int(answer.headers["retry-after"]) >= 1


def test_an_outage_answers_503_quickly_and_the_api_recovers_without_a_restart(
    system: System, database_url: str, database_name: str, server_url: str
) -> None:
    """With the database's connections cut and refused, every request is a 503 with Retry-After within a few
    seconds and /readyz is 503; once connections are allowed again the same process serves as before, and
    every job accepted before the outage is still there."""
    key = create_key_sync(database_url, "outage")
    api = system.api()
    with httpx.Client(base_url=api.base_url, timeout=30, headers={"Authorization": f"Bearer {key}"}) as client:
        accepted = [client.post("/stories/generate", json={"prompt": f"story {n}"},
                                headers={"Idempotency-Key": f"before-{n}"}) for n in range(3)]
        assert {answer.status_code for answer in accepted} == {202}
        job_urls = [answer.headers["location"] for answer in accepted]

        with database_refused(server_url, database_name):
            # the pool's cut connections first, then no connection at all
            for attempt in range(3):
                _assert_unavailable(_timed(client, "POST", "/stories/generate", json={"prompt": "an owl"},
                                           headers={"Idempotency-Key": f"during-{attempt}"}))
                _assert_unavailable(_timed(client, "GET", job_urls[0]))
            _assert_unavailable(_timed(client, "DELETE", job_urls[1]))
            _assert_unavailable(_timed(client, "GET", f"/stories/{uuid.uuid4()}"))
            _assert_unavailable(_timed(client, "GET", "/readyz"))
            assert _timed(client, "GET", "/healthz").status_code == 200

        wait_until_sync(lambda: client.get("/readyz").status_code == 200, timeout=20, interval=0.1,
                        what="the api to be ready again")
        assert [client.get(url).json()["status"] for url in job_urls] == ["pending"] * 3
        retried = client.post("/stories/generate", json={"prompt": "an owl"}, headers={"Idempotency-Key": "during-0"})
        assert retried.status_code == 202 and "idempotent-replayed" not in retried.headers
    assert api.popen.poll() is None
    assert any(event["event"] == "api.database_unavailable" for event in api.events())
    with psycopg.connect(database_url, autocommit=True) as conn:
        stored = {row[0] for row in conn.execute("SELECT public_id::text FROM story_jobs").fetchall()}
    assert stored == {answer.json()["job_id"] for answer in [*accepted, retried]}
