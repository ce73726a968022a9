"""Jobs in every state, with their ledger and stories, written straight into
the tables at chosen times: what the operators' console tests read back
through /ops (integration tier) and the console's page (system tier).

Times are seconds before the database's now(), so a test states "finished
ten minutes ago" without waiting for it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, TypeVar

import psycopg
from psycopg.types.json import Jsonb

from shared import keys, store

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """One ledger row: how a request to the provider ended."""

    outcome: str
    billed: bool = True
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: Decimal = Decimal(0)
    request_id: str | None = None
    error_text: str | None = None
    # the row's worst case, what an unknown outcome is charged (default: its cost,
    # as a request is never charged less than what it reported)
    worst_case_usd: Decimal | None = None
    # when the request was sent, seconds ago (default: when the job started)
    started_ago_s: float | None = None


@dataclass(frozen=True)
class Story:
    title: str
    body: str
    cost_usd: Decimal = Decimal("0.01")


@dataclass
class Job:
    """What to write; ``id`` and ``public_id`` are filled in by insert_job."""

    client_id: int
    status: str
    created_ago_s: float
    started_ago_s: float | None = None
    completed_ago_s: float | None = None
    error_code: str | None = None
    error_text: str | None = None
    worker_id: str | None = None
    calls: list[Call] = field(default_factory=list)
    story: Story | None = None
    prompt: str = "a fox who hums"
    id: int = 0
    public_id: uuid.UUID = uuid.UUID(int=0)


async def client(conn: psycopg.AsyncConnection[Any], name: str) -> tuple[int, str]:
    """A client and a key of its own: (client_id, key)."""
    new = await keys.create(conn, name)
    return await store.api_client_upsert(conn, name=name), new.key


async def operator_key(conn: psycopg.AsyncConnection[Any], name: str = "night shift") -> str:
    return (await keys.create_operator(conn, name)).key


def _ago(seconds: float | None) -> Any:
    return None if seconds is None else f"{seconds} seconds"


async def insert_job(conn: psycopg.AsyncConnection[Any], job: Job) -> Job:
    """Writes the job (with its story and ledger rows) as the api, a worker
    and the sweeper would have left it."""
    started = job.started_ago_s
    if started is None and job.status != "pending" and job.calls:
        started = job.created_ago_s - 1
    worker = job.worker_id or ("w-seed" if started is not None else None)
    cur = await conn.execute(
        """
        INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, status, error_code,
                                error_text, worker_id, progress, created_at, started_at, heartbeat_at, completed_at,
                                story_id, turn)
        VALUES (%(client_id)s, %(key)s, '\\x00', %(request)s, %(status)s::job_status, %(error_code)s, %(error_text)s,
                %(worker)s, %(progress)s, now() - %(created)s::interval, now() - %(started)s::interval,
                now() - %(started)s::interval, now() - %(completed)s::interval,
                CASE WHEN %(status)s = 'completed' THEN gen_random_uuid() END,
                -- the claim's order is the order they were made in
                extract(epoch FROM now() - %(created)s::interval))
        RETURNING id, public_id, story_id
        """,
        {"client_id": job.client_id, "key": uuid.uuid4().hex,
         "request": Jsonb({"prompt": job.prompt, "length": "short", "language": "en"}),
         "status": job.status, "error_code": job.error_code, "error_text": job.error_text, "worker": worker,
         "progress": sum(call.output_tokens for call in job.calls), "created": _ago(job.created_ago_s),
         "started": _ago(started), "completed": _ago(job.completed_ago_s)},
    )
    row = await cur.fetchone()
    assert row is not None
    job.id, job.public_id, story_id = row
    if job.story is not None:
        await conn.execute(
            """
            INSERT INTO stories (id, job_id, client_id, title, body, model, prompt_version, input_tokens,
                                 output_tokens, cost_usd)
            VALUES (coalesce(%(story_id)s, gen_random_uuid()), %(job_id)s, %(client_id)s, %(title)s, %(body)s,
                    'claude-sonnet-5-5', 'bedtime-v1', 100, 200, %(cost)s)
            """,
            {"story_id": story_id, "job_id": job.id, "client_id": job.client_id, "title": job.story.title,
             "body": job.story.body, "cost": job.story.cost_usd},
        )
    for attempt, call in enumerate(job.calls, start=1):
        sent = call.started_ago_s if call.started_ago_s is not None else started
        await conn.execute(
            """
            INSERT INTO llm_calls (job_id, attempt, worker_id, provider, model, started_at, finished_at, outcome,
                                   billed, input_tokens, output_tokens, cost_usd, worst_case_usd, request_id,
                                   error_text)
            VALUES (%(job_id)s, %(attempt)s, %(worker)s, 'anthropic', 'claude-sonnet-5-5',
                    now() - %(sent)s::interval,
                    CASE WHEN %(outcome)s <> 'started' THEN now() - %(sent)s::interval + interval '1 second' END,
                    %(outcome)s, %(billed)s, %(input)s, %(output)s, %(cost)s, %(worst)s, %(request_id)s,
                    %(error_text)s)
            """,
            {"job_id": job.id, "attempt": attempt, "worker": worker or "w-seed", "sent": _ago(sent or 0),
             "outcome": call.outcome, "billed": call.billed, "input": call.input_tokens,
             "output": call.output_tokens, "cost": call.cost_usd,
             "worst": call.cost_usd if call.worst_case_usd is None else call.worst_case_usd, "request_id": call.request_id,
             "error_text": call.error_text},
        )
    return job


async def insert_jobs(conn: psycopg.AsyncConnection[Any], jobs: list[Job]) -> list[Job]:
    """Writes the jobs oldest first, so that ids grow with created_at as they
    do when the api admits them; returns them in the order given."""
    for job in sorted(jobs, key=lambda job: -job.created_ago_s):
        await insert_job(conn, job)
    return jobs


def completed(client_id: int, finished_ago_s: float, *, cost: str = "0.020000", **more: Any) -> Job:
    """A job written and delivered, one billed call."""
    return Job(client_id=client_id, status="completed", created_ago_s=finished_ago_s + 90,
               started_ago_s=finished_ago_s + 80, completed_ago_s=finished_ago_s,
               calls=[Call("succeeded", input_tokens=300, output_tokens=900, cost_usd=Decimal(cost),
                           request_id=f"req_{uuid.uuid4().hex[:12]}")],
               story=Story("The Fox", "Once upon a time."), **more)


def failed(client_id: int, finished_ago_s: float, error_code: str, *, calls: list[Call] | None = None,
           **more: Any) -> Job:
    return Job(client_id=client_id, status="failed", created_ago_s=finished_ago_s + 90,
               started_ago_s=None if calls is None else finished_ago_s + 80, completed_ago_s=finished_ago_s,
               error_code=error_code, error_text=f"{error_code} happened", calls=calls or [], **more)


def pending(client_id: int, created_ago_s: float, **more: Any) -> Job:
    return Job(client_id=client_id, status="pending", created_ago_s=created_ago_s, **more)


def running(client_id: int, started_ago_s: float, *, calls: list[Call] | None = None, **more: Any) -> Job:
    """A job a worker holds, its request open (by default)."""
    return Job(client_id=client_id, status="running", created_ago_s=started_ago_s + 5, started_ago_s=started_ago_s,
               calls=[Call("started")] if calls is None else calls, **more)


async def batch(conn: psycopg.AsyncConnection[Any], state: str, jobs: list[Job], *, created_ago_s: float,
                provider_batch_id: str | None = None, counts: dict[str, int] | None = None,
                processing_status: str | None = None, expires_in_s: float | None = None) -> int:
    """A message batch in ``state`` holding the (already inserted) ``jobs``, each as its item (attempt 1) with
    its first ledger row naming the batch; the jobs become batch-lane jobs owned by it. Its id."""
    cur = await conn.execute(
        """
        INSERT INTO message_batches (state, provider_batch_id, model, request_count, fence_at, created_at, sent_at,
                                     expires_at, processing_status, request_counts, holder)
        VALUES (%(state)s, %(provider)s, 'claude-sonnet-5-5', %(count)s, now() - %(ago)s::interval,
                now() - %(ago)s::interval, CASE WHEN %(provider)s::text IS NOT NULL THEN now() - %(ago)s::interval END,
                now() + %(expires)s::interval, %(processing_status)s, %(counts)s, 'w-seed')
        RETURNING id
        """,
        {"state": state, "provider": provider_batch_id, "count": len(jobs), "ago": _ago(created_ago_s),
         "expires": _ago(expires_in_s if expires_in_s is not None else 86400 - created_ago_s),
         "counts": None if counts is None else Jsonb({"processing": 0, **counts}),
         "processing_status": processing_status},
    )
    row = await cur.fetchone()
    assert row is not None
    batch_id = int(row[0])
    for job in jobs:
        await conn.execute("UPDATE story_jobs SET lane = 'batch', batch_id = %(b)s, worker_id = 'batch-' || %(b)s "
                           "WHERE id = %(job)s", {"b": batch_id, "job": job.id})
        await conn.execute("INSERT INTO message_batch_items (batch_id, custom_id, job_id, attempt, result) "
                           "VALUES (%(b)s, 'sj-' || %(b)s || '-' || %(job)s || '-1', %(job)s, 1, "
                           "CASE WHEN %(done)s THEN 'succeeded' END)",
                           {"b": batch_id, "job": job.id, "done": job.status == "completed"})
        await conn.execute("UPDATE llm_calls SET batch_id = %s WHERE job_id = %s AND attempt = 1", (batch_id, job.id))
    return batch_id


def seeded(database_url: str, make: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]) -> T:
    """Runs ``make`` on a connection of its own, on a thread of its own: for
    tests that are not async (Playwright's sync API runs in their thread)."""

    async def run() -> T:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            return await make(conn)

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, run()).result()
