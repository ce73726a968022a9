"""What a waiting client sees: queue position, progress, cancellation."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from api.pacing import DrainStatsCache
from api.store import ApiStore
from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer, Plan
from tests.support.api_client import api_client
from tests.support.database import client_id_of, count, enqueue, job_rows
from tests.support.settings import worker_settings
from tests.support.waiting import wait_until
from tests.support.workers import running_worker
from worker.anthropic_writer import AnthropicWriter


@pytest.fixture
async def client(pool: AsyncConnectionPool, api_key: str) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(pool, api_key) as test_client:
        yield test_client


async def _post(client: httpx.AsyncClient, prompt: str) -> str:
    answer = await client.post("/stories/generate", json={"prompt": prompt},
                               headers={"Idempotency-Key": str(uuid.uuid4())})
    assert answer.status_code == 202, answer.text
    return str(answer.json()["job_id"])


async def test_queue_position_counts_the_jobs_ahead(client: httpx.AsyncClient) -> None:
    """Three pending jobs are at positions 1, 2 and 3, with Retry-After, revalidated on every poll."""
    job_ids = [await _post(client, f"story {n}") for n in range(3)]
    positions = []
    for job_id in job_ids:
        answer = await client.get(f"/stories/jobs/{job_id}")
        assert answer.status_code == 200
        assert answer.headers["cache-control"] == "private, no-cache" and int(answer.headers["retry-after"]) >= 1
        body = answer.json()
        assert body["status"] == "pending" and body["progress"] is None and body["story"] is None
        positions.append(body["queue_position"])
    assert positions == [1, 2, 3]


async def test_cancelling_a_pending_job_fails_it_at_once(client: httpx.AsyncClient) -> None:
    """DELETE on a pending job answers it failed as cancelled; a second DELETE is 409."""
    job_id = await _post(client, "a fox")
    answer = await client.delete(f"/stories/jobs/{job_id}")
    assert answer.status_code == 200
    assert answer.json()["status"] == "failed" and answer.json()["error"]["code"] == "cancelled"
    again = await client.delete(f"/stories/jobs/{job_id}")
    assert again.status_code == 409 and again.headers["content-type"].startswith("application/problem+json")


async def test_cancelling_another_clients_job_is_not_found(
    client: httpx.AsyncClient, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A client cannot cancel (or see) another client's job: the same 404 as an unknown id."""
    from tests.support.database import create_key

    job_id = await _post(client, "a fox")
    other = await create_key(conn, "someone else")
    answer = await client.delete(f"/stories/jobs/{job_id}", headers={"Authorization": f"Bearer {other}"})
    assert answer.status_code == 404
    unknown = await client.delete(f"/stories/jobs/{uuid.uuid4()}", headers={"Authorization": f"Bearer {other}"})
    assert unknown.status_code == 404 and unknown.json() == answer.json()
    (row,) = await job_rows(conn)
    assert row.status == "pending"


async def test_cancelling_a_running_job_closes_its_stream_and_stores_no_story(
    client: httpx.AsyncClient, conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
) -> None:
    """A running job cancelled by its client: the worker closes the provider stream at its next
    heartbeat, long before the stream would have ended, records it as stopped, the job reads
    cancelled, and no story is stored."""
    interval = 0.3
    with FakeAnthropicServer(FakeAnthropic(default=Plan(chunks=200, duration_s=60))) as provider:
        settings = worker_settings(anthropic_api_key="test", anthropic_base_url=provider.base_url,
                                   heartbeat_interval_s=interval)
        writer = AnthropicWriter(settings)
        try:
            async with running_worker(settings, pool, writer, listen_url=database_url):
                job_id = await _post(client, "a restless moon")
                await asyncio.to_thread(provider.fake.wait_for, lambda f: f.calls and f.calls[0].chunks_sent >= 2)
                running = (await client.get(f"/stories/jobs/{job_id}")).json()
                assert running["status"] == "running"
                answer = await client.delete(f"/stories/jobs/{job_id}")
                assert answer.status_code == 200 and answer.json()["error"]["code"] == "cancelled"
                await asyncio.to_thread(provider.fake.wait_for, lambda f: f.calls[0].closed_early, 10)
                await wait_until(lambda: _ledger_closed(conn), what="the ledger row to be closed")
        finally:
            await writer.aclose()
    assert provider.fake.calls[0].chunks_sent < 200
    final = (await client.get(f"/stories/jobs/{job_id}")).json()
    assert final["status"] == "failed" and final["error"]["code"] == "cancelled" and final["story"] is None
    assert await count(conn, "SELECT count(*) FROM stories") == 0
    assert await count(conn, "SELECT count(*) FROM llm_calls WHERE outcome = 'stopped' AND billed") == 1


async def _ledger_closed(conn: psycopg.AsyncConnection[Any]) -> bool:
    return await count(conn, "SELECT count(*) FROM llm_calls WHERE outcome = 'stopped'") == 1


async def test_a_completed_job_links_its_story(
    client: httpx.AsyncClient, conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
) -> None:
    """The final answer carries the story and its story_url, which serves the same story."""
    from worker.offline import OfflineWriter

    settings = worker_settings()
    async with running_worker(settings, pool, OfflineWriter(0), listen_url=database_url):
        job_id = await _post(client, "a kind giant")

        async def completed() -> bool:
            return bool((await client.get(f"/stories/jobs/{job_id}")).json()["status"] == "completed")

        await wait_until(completed, what="the job to complete")
    answer = await client.get(f"/stories/jobs/{job_id}")
    body = answer.json()
    assert "retry-after" not in answer.headers
    assert body["story_url"] == f"/stories/{body['story']['story_id']}"
    story = (await client.get(body["story_url"])).json()
    assert story["text"] == body["story"]["text"] and story["job_id"] == job_id
    assert "a kind giant" in story["text"]


async def test_the_drain_statistics_are_read_from_the_pool_and_a_failed_read_leaves_them_out(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The statistics behind an estimate are read on a connection of the cache's pool (the poll holds none
    then); when none can be had (a pool never opened here) the estimate is left out, logged, never an error."""
    async with AsyncConnectionPool(database_url, min_size=1, max_size=1, open=False) as pool:
        assert await DrainStatsCache(pool).get() is not None
    unopened = AsyncConnectionPool(database_url, open=False)
    with capture_logs() as logs:
        assert await DrainStatsCache(unopened, timeout_s=0.5).get() is None
    assert [e["event"] for e in logs] == ["api.drain_stats_unavailable"]


@pytest.mark.parametrize(("oldest_started_s_ago", "claimed"), [(120, 3), (30, 0)])
async def test_the_claims_of_the_last_minute_count_only_once_the_newest_jobs_reach_back_a_minute(
    conn: psycopg.AsyncConnection[Any], oldest_started_s_ago: int, claimed: int,
) -> None:
    """claimed_last_minute (what Retry-After is paced by) counts the newest jobs claimed in the last minute once
    those reach back a whole minute; a burst of claims younger than a minute (workers starting) is no rate."""
    client = await client_id_of(conn)
    for n in range(4):
        await enqueue(conn, client, f"story {n}")
    await conn.execute("UPDATE story_jobs SET status = 'running', worker_id = 'w', heartbeat_at = now(), "
                       "started_at = now() - make_interval(secs => CASE WHEN id = (SELECT min(id) FROM story_jobs) "
                       "THEN %s ELSE 10 END)", (oldest_started_s_ago,))
    stats = await ApiStore(conn).job_drain_stats()
    assert stats.claimed_last_minute == claimed
