"""Helpers for the api's tests: the app in the test's event loop, answers
checked as problem details, and a completed job made by a real worker."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import psycopg
from opentelemetry.trace import TracerProvider
from psycopg_pool import AsyncConnectionPool

from api.app import create_app
from tests.support.database import count
from tests.support.settings import api_settings, worker_settings
from tests.support.waiting import wait_until
from tests.support.workers import running_worker
from worker.offline import OfflineWriter


@contextlib.asynccontextmanager
async def api_client(pool: AsyncConnectionPool, api_key: str | None = None, *,
                     tracer_provider: TracerProvider | None = None, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of ``create_app(api_settings(**settings), pool)`` running
    in this event loop (httpx's ASGI transport), so that concurrent requests
    really run concurrently on the test's pool. (Litestar's AsyncTestClient
    runs the app on a thread of its own and blocks this loop while a request
    runs: requests would queue, and a pool of this loop could not grow.)"""
    app = create_app(api_settings(**settings), pool, tracer_provider=tracer_provider)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # Litestar types the ASGI scope narrower than httpx does; the app is the same ASGI app
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://storyjobs.test", headers=headers) as client:
        yield client


def new_key() -> dict[str, str]:
    return {"Idempotency-Key": str(uuid.uuid4())}


def assert_problem(answer: httpx.Response, status: int) -> dict[str, Any]:
    """The answer is an RFC 9457 problem with this status, never cached; returns its body."""
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/problem+json", answer.headers
    assert answer.headers["cache-control"] == "no-store"
    body: dict[str, Any] = answer.json()
    assert body["status"] == status and body["title"]
    return body


async def stored_jobs(conn: psycopg.AsyncConnection[Any]) -> int:
    return await count(conn, "SELECT count(*) FROM story_jobs")


async def completed_job(client: httpx.AsyncClient, pool: AsyncConnectionPool, database_url: str,
                        prompt: str) -> dict[str, Any]:
    """Starts a job as ``client`` and lets an in-process worker (the offline
    writer) complete it; returns the job's final answer, story included."""
    answer = await client.post("/stories/generate", json={"prompt": prompt}, headers=new_key())
    assert answer.status_code == 202, answer.text
    job_url = answer.headers["location"]
    async with running_worker(worker_settings(), pool, OfflineWriter(0), listen_url=database_url):

        async def completed() -> bool:
            return bool((await client.get(job_url)).json()["status"] == "completed")

        await wait_until(completed, what="the job to complete")
    final: dict[str, Any] = (await client.get(job_url)).json()
    return final
