"""One billed request per job at most, and none for a job that is no longer
ours, at the edges: absurd usage counts, an end the database refuses, odd
rate-limit headers, the database gone during a 429's wait, a cancel or a
timeout during that wait, and an outcome that may have been billed. Each
case runs the worker coordinator on a real Postgres, with the real
``anthropic`` SDK against the fake provider, whose ``billed`` list is what
the provider charged."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator, MutableMapping
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from api.admission import admission
from api.store import ApiStore
from shared import prompt
from shared.config import ApiSettings
from shared.story_request import StoryRequest
from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer, Plan
from tests.support import postgres_server
from tests.support.database import client_id_of, enqueue
from tests.support.settings import worker_settings
from tests.support.waiting import wait_until
from tests.support.workers import running_worker
from worker.anthropic_writer import AnthropicWriter
from worker.coordinator import Coordinator

# a final usage no integer column holds
ABSURD_OUTPUT_TOKENS = 3_000_000_000
PRICED: dict[str, Any] = {"llm_model": "priced-model", "llm_prices": {"priced-model": (2.0, 10.0)}}
API = ApiSettings(**PRICED)
PROMPT = "a sleepy otter"
Logs = list[MutableMapping[str, Any]]  # what capture_logs() collects


@pytest.fixture
def provider() -> Iterator[FakeAnthropicServer]:
    with FakeAnthropicServer(FakeAnthropic(default=Plan(chunks=4))) as server:
        yield server


@contextlib.asynccontextmanager
async def _worker(pool: AsyncConnectionPool, database_url: str, provider: FakeAnthropicServer,
                  **settings: Any) -> AsyncIterator[Coordinator]:
    """A worker coordinator calling the fake provider through the anthropic SDK; stopped on exit."""
    worker_config = worker_settings(anthropic_api_key="test", anthropic_base_url=provider.base_url, **settings)
    writer = AnthropicWriter(worker_config)
    try:
        async with running_worker(worker_config, pool, writer, listen_url=database_url) as worker:
            yield worker
    finally:
        await writer.aclose()


class Job:
    """A job's row and its ledger, as the tests read them."""

    def __init__(self, row: tuple[Any, ...], ledger: list[tuple[Any, ...]]) -> None:
        self.status: str
        (self.id, self.status, self.error_code, self.worker_id, self.max_tokens, self.input_tokens_estimate,
         self.reserved_usd, self.charged_usd) = row
        # (attempt, outcome, billed, input_tokens, output_tokens, cost_usd)
        self.ledger = ledger

    @property
    def calls(self) -> list[tuple[int, str, bool]]:
        return [(attempt, outcome, billed) for attempt, outcome, billed, *_ in self.ledger]


async def _job(conn: psycopg.AsyncConnection[Any], public_id: uuid.UUID) -> Job:
    cur = await conn.execute("SELECT id, status::text, error_code, worker_id, max_tokens, input_tokens_estimate, "
                             "reserved_usd, charged_usd FROM story_jobs WHERE public_id = %s", (public_id,))
    row = await cur.fetchone()
    assert row is not None
    cur = await conn.execute("SELECT attempt, outcome, billed, input_tokens, output_tokens, cost_usd FROM llm_calls "
                             "WHERE job_id = %s ORDER BY attempt", (row[0],))
    return Job(row, await cur.fetchall())


async def _status(conn: psycopg.AsyncConnection[Any], public_id: uuid.UUID) -> str:
    return (await _job(conn, public_id)).status


async def _ended(conn: psycopg.AsyncConnection[Any], public_id: uuid.UUID) -> bool:
    return await _status(conn, public_id) in ("completed", "failed")


def _logged(logs: Logs, event: str, **fields: Any) -> int:
    return sum(1 for e in logs if e["event"] == event and all(e.get(k) == v for k, v in fields.items()))


async def _cut_until_a_round_fails(conn: psycopg.AsyncConnection[Any], logs: Logs) -> None:
    """Terminates every backend of the test database but conn's (the worker's pool and its LISTEN), until
    a round of the coordinator fails on a cut connection (its claim's answer lost); returns once a later
    round succeeded, which looked for the claims of that lost answer."""
    before = _logged(logs, "worker.database_error", task="coordinator")
    for _ in range(10):
        await conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                           "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        with contextlib.suppress(TimeoutError):
            await wait_until(lambda: _logged(logs, "worker.database_error", task="coordinator") > before,
                             timeout=2, what="a round to fail on a cut connection")
            break
    else:
        raise AssertionError("no round of the worker ever failed on a cut connection")
    recovered = _logged(logs, "worker.database_recovered", task="coordinator")
    await wait_until(lambda: _logged(logs, "worker.database_recovered", task="coordinator") > recovered,
                     timeout=10, what="a round to succeed after the cut")


# -- 1. an absurd final usage, then the connections cut ------------------------------------------


def _answered_and_let_go(provider: FakeAnthropicServer, worker: Coordinator) -> bool:
    """The story was streamed to its end and the worker holds no job: its end was written, or (before
    the held set was kept until then) the job was dropped, still running."""
    calls = provider.fake.calls
    return bool(calls) and calls[0].finished and not worker.held_job_ids


async def test_an_absurd_final_usage_is_charged_max_tokens_and_never_sent_again(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer,
) -> None:
    """A final usage of three billion output tokens completes the job charged its max_tokens, and
    cutting the worker's connections afterwards sends no second request: one billed request, one row."""
    provider.fake.queue(Plan(chunks=4, final_output_tokens=ABSURD_OUTPUT_TOKENS))
    settings = worker_settings(anthropic_api_key="test")
    with capture_logs() as logs:
        async with _worker(pool, database_url, provider, worker_concurrency=2) as worker:
            public_id = await enqueue(conn, await client_id_of(conn), PROMPT)
            await wait_until(lambda: _answered_and_let_go(provider, worker), timeout=20,
                             what="the story to be streamed and let go")
            await _cut_until_a_round_fails(conn, logs)
    # the worker has stopped: every request it could send was sent
    job = await _job(conn, public_id)
    assert len(provider.fake.calls) == 1 and len(provider.fake.billed) == 1
    assert (job.status, job.error_code) == ("completed", None)
    ((attempt, outcome, billed, input_tokens, output_tokens, cost_usd),) = job.ledger
    assert (attempt, outcome, billed, output_tokens) == (1, "succeeded", True, job.max_tokens)
    assert cost_usd == settings.price().cost(input_tokens, job.max_tokens)
    cur = await conn.execute("SELECT output_tokens, cost_usd FROM stories")
    assert await cur.fetchall() == [(job.max_tokens, cost_usd)]
    assert _logged(logs, "llm.odd_value", what="usage.output_tokens") >= 1
    assert _logged(logs, "job.adopted") == 0


async def test_an_end_the_database_refuses_keeps_the_job_held_and_is_never_sent_again(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer,
) -> None:
    """With the database refusing the story and the failure that replaces it, the job stays running under
    its worker through a cut of its connections, no second request is sent, and once the database takes
    it the job's end is written with its one billed call and the worker holds nothing."""
    provider.fake.queue(Plan(chunks=4, final_output_tokens=ABSURD_OUTPUT_TOKENS))
    await conn.execute("ALTER TABLE stories ADD CONSTRAINT t_refuse_story CHECK (body NOT LIKE '%sleepy%')")
    await conn.execute("ALTER TABLE story_jobs ADD CONSTRAINT t_refuse_failure CHECK (status <> 'failed') NOT VALID")
    with capture_logs() as logs:
        async with _worker(pool, database_url, provider, worker_concurrency=2) as worker:
            public_id = await enqueue(conn, await client_id_of(conn), PROMPT)
            await wait_until(lambda: _logged(logs, "job.end_refused") > 0 or _answered_and_let_go(provider, worker),
                             timeout=20, what="the story and its failure to be refused")
            await _cut_until_a_round_fails(conn, logs)
            job = await _job(conn, public_id)
            assert (job.status, job.worker_id) == ("running", worker.worker_id)
            assert worker.held_job_ids == [job.id]
            assert len(provider.fake.calls) == 1
            await conn.execute("ALTER TABLE stories DROP CONSTRAINT t_refuse_story")
            await conn.execute("ALTER TABLE story_jobs DROP CONSTRAINT t_refuse_failure")
            await wait_until(lambda: _ended(conn, public_id), timeout=30, what="the job's end to be written")
            await wait_until(lambda: not worker.held_job_ids, timeout=10, what="the worker to let the job go")
    # the worker has stopped: every request it could send was sent
    job = await _job(conn, public_id)
    assert len(provider.fake.calls) == 1 and len(provider.fake.billed) == 1
    assert (job.status, job.error_code) in (("failed", "internal_error"), ("completed", None))
    ((attempt, _, billed, _, output_tokens, _),) = job.ledger
    assert (attempt, billed, output_tokens) == (1, True, job.max_tokens)
    assert _logged(logs, "job.adopted") == 0


# -- 2. odd numbers in the provider's headers ----------------------------------------------------


@pytest.mark.parametrize("headers", [
    (("anthropic-ratelimit-output-tokens-remaining", "nan"), ("anthropic-ratelimit-output-tokens-limit", "1000")),
    (("anthropic-ratelimit-requests-remaining", "0"), ("anthropic-ratelimit-requests-limit", "nan"),
     ("anthropic-ratelimit-requests-reset", "not-a-date")),
    (("anthropic-ratelimit-requests-remaining", "0"), ("anthropic-ratelimit-requests-limit", "1e-300")),
], ids=["remaining-nan", "limit-nan-reset-not-a-date", "limit-absurdly-small"])
async def test_odd_rate_limit_headers_leave_the_worker_alive(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer, headers: tuple[tuple[str, str], ...],
) -> None:
    """An answer whose anthropic-ratelimit-* headers hold numbers no one can use completes its job, and
    the worker, which tells them to the claim round that follows, lives on to run the next job."""
    provider.fake.queue(Plan(chunks=4, headers=headers))
    client = await client_id_of(conn)
    with capture_logs() as logs:
        async with _worker(pool, database_url, provider) as worker:
            first = await enqueue(conn, client, PROMPT)
            await wait_until(lambda: _ended(conn, first), timeout=20, what="the first job to end")
            second = await enqueue(conn, client, "a drowsy badger")
            await wait_until(lambda: _ended(conn, second), timeout=20, what="the second job to end")
            assert not worker.held_job_ids
    for public_id in (first, second):
        job = await _job(conn, public_id)
        assert job.status == "completed" and job.calls == [(1, "succeeded", True)]
    assert len(provider.fake.billed) == 2
    assert _logged(logs, "worker.task_crashed") == 0 and _logged(logs, "job.unexpected_error") == 0


async def test_a_429_whose_retry_after_is_nan_is_retried(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer,
) -> None:
    """A 429 with retry-after: nan is retried after the worker's own wait: the job completes, the 429's row
    not billed and the retry's billed."""
    provider.fake.queue(Plan(status=429, headers=(("retry-after", "nan"),)))
    with capture_logs() as logs:
        async with _worker(pool, database_url, provider):
            public_id = await enqueue(conn, await client_id_of(conn), PROMPT)
            await wait_until(lambda: _ended(conn, public_id), timeout=20, what="the job to end")
    job = await _job(conn, public_id)
    assert (job.status, job.error_code) == ("completed", None)
    assert job.calls == [(1, "rate_limited", False), (2, "succeeded", True)]
    assert [c.status for c in provider.fake.calls] == [429, 200] and len(provider.fake.billed) == 1
    # a wait came first (a 429 without a usable retry-after holds every request for a second), not a
    # sleep of nan, which ends at once or never
    rate_limited, retried = provider.fake.calls
    assert retried.received_at - rate_limited.received_at >= 0.4
    assert _logged(logs, "job.unexpected_error") == 0


# -- 3. the database gone during a 429's wait ----------------------------------------------------


async def test_a_database_outage_during_a_429s_wait_does_not_fail_the_job(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str, server_url: str,
    database_name: str, provider: FakeAnthropicServer,
) -> None:
    """The database refusing connections while a 429's retry-after runs out, and when the retry's ledger
    row is due, holds the job back without failing it: it completes once the database is back, the 429
    not billed and the retry billed, one billed request."""
    provider.fake.queue(Plan(status=429, headers=(("retry-after", "3"),)))
    with capture_logs() as logs:
        async with _worker(pool, database_url, provider):
            public_id = await enqueue(conn, await client_id_of(conn), PROMPT)
            await wait_until(lambda: len(provider.fake.calls) == 1, what="the 429")
            with postgres_server.database_refused(server_url, database_name):
                # the outage lasts until the retry's ledger statement has failed on it (or, before the
                # retry's statement was waited through, until the job failed of it)
                await wait_until(lambda: (_logged(logs, "worker.database_error", task="retry")
                                          + _logged(logs, "job.unexpected_error")) > 0,
                                 timeout=15, what="the retry's ledger statement to meet the outage")
            async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as again:
                await wait_until(lambda: _ended(again, public_id), timeout=30, what="the job to end")
                job = await _job(again, public_id)
    assert (job.status, job.error_code) == ("completed", None)
    assert job.calls == [(1, "rate_limited", False), (2, "succeeded", True)]
    assert [c.status for c in provider.fake.calls] == [429, 200] and len(provider.fake.billed) == 1
    assert _logged(logs, "job.unexpected_error") == 0


# -- 4. a cancel, or LLM_TIMEOUT_S, during a 429's wait ---------------------------------------


async def test_a_cancel_during_a_429s_wait_leaves_the_429_unbilled(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer,
) -> None:
    """Cancelled (as DELETE does) while a 429's retry-after runs, the job's call is stopped by the next
    heartbeat: the 429's row stays rate_limited and not billed, and no second request is sent."""
    provider.fake.queue(Plan(status=429, headers=(("retry-after", "3"),)))
    client = await client_id_of(conn)
    with capture_logs() as logs:
        async with _worker(pool, database_url, provider, heartbeat_interval_s=0.2) as worker:
            public_id = await enqueue(conn, client, PROMPT)
            # the worker's answer to the 429, not the fake's record of the
            # request: cancelled before that, the request counts as sent
            await wait_until(lambda: _logged(logs, "llm.retryable") == 1, what="the 429 answered")
            cancelled = await ApiStore(conn).job_cancel(client_id=client, job_id=public_id)
            assert cancelled is not None and cancelled.cancelled
            await wait_until(lambda: not worker.held_job_ids, timeout=10, what="the worker to let the job go")
    # the worker has stopped: every request it could send was sent
    job = await _job(conn, public_id)
    assert (job.status, job.error_code) == ("failed", "cancelled")
    assert job.calls == [(1, "rate_limited", False)]
    assert len(provider.fake.calls) == 1 and not provider.fake.billed
    assert _logged(logs, "job.lost_ownership") == 1


async def test_llm_timeout_during_a_429s_wait_leaves_the_429_unbilled(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer,
) -> None:
    """LLM_TIMEOUT_S running out while a 429's retry-after runs fails the job as llm_error with the 429's
    row rate_limited and not billed, and no second request is sent."""
    # the deadline well past the 429's arrival and well before its retry-after
    provider.fake.queue(Plan(status=429, headers=(("retry-after", "6"),)))
    async with _worker(pool, database_url, provider, llm_timeout_s=2.5) as worker:
        public_id = await enqueue(conn, await client_id_of(conn), PROMPT)
        await wait_until(lambda: _ended(conn, public_id), timeout=20, what="the job to end")
        await wait_until(lambda: not worker.held_job_ids, timeout=10, what="the worker to let the job go")
    job = await _job(conn, public_id)
    assert (job.status, job.error_code) == ("failed", "llm_error")
    assert job.calls == [(1, "rate_limited", False)]
    assert (job.charged_usd or 0) == 0
    assert len(provider.fake.calls) == 1 and not provider.fake.billed


# -- 5. an outcome that may have been billed -----------------------------------------------------


async def _fails_on_a_500(conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
                          provider: FakeAnthropicServer) -> Job:
    """A job admitted under a day's budget (its worst case reserved) whose one request is answered 500."""
    provider.fake.queue(Plan(status=500))
    client = await client_id_of(conn)
    (admitted,) = await ApiStore(conn).job_insert_if_admitted(
        admissions=[admission(client, uuid.uuid4().hex, StoryRequest(prompt=PROMPT), API)],
        queue_max=100, client_queue_max=100, budget_usd=Decimal(100))
    assert admitted.outcome == "inserted" and admitted.public_id is not None
    public_id = admitted.public_id
    async with _worker(pool, database_url, provider, **PRICED) as worker:
        await wait_until(lambda: _ended(conn, public_id), timeout=20, what="the job to end")
        await wait_until(lambda: not worker.held_job_ids, timeout=10, what="the worker to let the job go")
    job = await _job(conn, public_id)
    assert (job.status, job.error_code) == ("failed", "llm_error")
    assert job.reserved_usd > 0 and len(provider.fake.calls) == 1
    return job


async def test_a_500_before_the_stream_is_billed_at_the_jobs_worst_case(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer,
) -> None:
    """A 500 before anything streamed may have been billed: its ledger row is billed, at the job's worst
    case (max_tokens, and its input estimate or the bound its reservation counts, at the model's price),
    not at nothing."""
    job = await _fails_on_a_500(conn, pool, database_url, provider)
    ((attempt, outcome, billed, input_tokens, output_tokens, cost_usd),) = job.ledger
    assert (attempt, outcome, billed) == (1, "failed", True)
    assert output_tokens == job.max_tokens
    assert input_tokens in (job.input_tokens_estimate, prompt.input_tokens_at_most(StoryRequest(prompt=PROMPT)))
    assert cost_usd == API.price().worst_case(input_tokens, job.max_tokens) > 0


async def test_a_500_before_the_stream_charges_the_budget_the_jobs_reservation(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer,
) -> None:
    """A 500 before anything streamed, an outcome that cannot be known, charges the day's budget the
    job's whole reservation, as a sweep would, and releases none of it as unspent."""
    job = await _fails_on_a_500(conn, pool, database_url, provider)
    cur = await conn.execute("SELECT spent_usd, reserved_usd FROM budget_days WHERE client_id = 0")
    assert await cur.fetchall() == [(job.reserved_usd, 0)]


async def test_a_job_ended_while_its_retry_waits_is_charged_nothing_for_its_refused_call(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
    provider: FakeAnthropicServer,
) -> None:
    """Cancelled during a 429's wait and found gone by the retry itself (no heartbeat in between), the job
    whose one request was refused is charged nothing: the cancel's worst-case charge comes down to $0 and
    the day's budget with it."""
    provider.fake.queue(Plan(status=429, headers=(("retry-after", "2"),)))
    client = await client_id_of(conn)
    (admitted,) = await ApiStore(conn).job_insert_if_admitted(
        admissions=[admission(client, uuid.uuid4().hex, StoryRequest(prompt=PROMPT), API)],
        queue_max=100, client_queue_max=100, budget_usd=Decimal(100))
    assert admitted.public_id is not None
    async with _worker(pool, database_url, provider, heartbeat_interval_s=30, heartbeat_timeout_s=120,
                       **PRICED) as worker:
        await wait_until(lambda: len(provider.fake.calls) == 1, what="the 429")
        cancelled = await ApiStore(conn).job_cancel(client_id=client, job_id=admitted.public_id)
        assert cancelled is not None and cancelled.cancelled
        await wait_until(lambda: not worker.held_job_ids, timeout=10, what="the worker to let the job go")
    job = await _job(conn, admitted.public_id)
    assert job.reserved_usd > 0 and job.charged_usd == 0
    assert [row[:3] for row in job.ledger] == [(1, "rate_limited", False)]
    cur = await conn.execute("SELECT spent_usd, reserved_usd FROM budget_days WHERE client_id = 0")
    assert await cur.fetchall() == [(0, 0)]
    assert len(provider.fake.calls) == 1
