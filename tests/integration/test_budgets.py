"""Spend budgets on a real Postgres: admission reserves worst cases under the
admission lock, and every way a job ends turns its reservation into what it
cost, exactly once; a story refused for the budget is told to retry when the
budget's day ends."""

from __future__ import annotations

import asyncio
import math
import uuid
from datetime import UTC, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from api.admission import admission
from api.store import ApiStore
from shared import store
from shared.config import ApiSettings
from shared.status import ErrorCode, LlmOutcome
from shared.story_request import StoryRequest
from sweeper.store import PgSweeperStore
from tests.support import worker_statements
from tests.support.api_client import api_client, assert_problem, new_key
from tests.support.database import client_id_of
from worker.pg_store import PgWorkerStore
from worker.rows import Completion, Failure
from worker.store import ClaimAsk

SETTINGS = ApiSettings()
WORST = admission(1, "k", StoryRequest(prompt="a fox"), SETTINGS).worst_case_usd


async def _admit(conn: psycopg.AsyncConnection[Any], client: int, n: int, *, budget: Decimal | None = None,
                 client_budget: Decimal | None = None) -> list[str]:
    results = await ApiStore(conn).job_insert_if_admitted(
        admissions=[admission(client, uuid.uuid4().hex, StoryRequest(prompt="a fox"), SETTINGS)
                    for _ in range(n)],
        queue_max=1000, client_queue_max=1000, budget_usd=budget, client_budget_usd=client_budget)
    return [r.outcome for r in results]


async def _day(conn: psycopg.AsyncConnection[Any], client_id: int = 0) -> tuple[Decimal, Decimal]:
    cur = await conn.execute("SELECT spent_usd, reserved_usd FROM budget_days WHERE client_id = %s", (client_id,))
    row = await cur.fetchone()
    return (Decimal(0), Decimal(0)) if row is None else (row[0], row[1])


async def _claim(conn: psycopg.AsyncConnection[Any], n: int) -> list[int]:
    result = await worker_statements.job_claim(conn, worker_id="w", claim_limit=n,
                                              provider="anthropic", model="m")
    return [job.id for job in result.claimed]


async def test_admission_reserves_worst_cases_up_to_the_budget_and_no_further(
    conn: psycopg.AsyncConnection[Any]
) -> None:
    """A budget of 3.5 worst cases admits 3 of 5, refuses 2 as budget_exhausted, and reserves exactly
    three worst cases; without a budget nothing is reserved."""
    client = await client_id_of(conn)
    outcomes = await _admit(conn, client, 5, budget=WORST * Decimal("3.5"))
    assert outcomes == ["inserted"] * 3 + ["budget_exhausted"] * 2
    assert await _day(conn) == (Decimal(0), WORST * 3) and await _day(conn, client) == (Decimal(0), WORST * 3)
    other = await client_id_of(conn, "unbudgeted")
    assert await _admit(conn, other, 2) == ["inserted"] * 2
    assert await _day(conn, other) == (Decimal(0), Decimal(0))


async def test_a_clients_own_budget_overrides_the_default_and_is_checked_first(
    conn: psycopg.AsyncConnection[Any]
) -> None:
    """A client with a budget of its own (2.5 worst cases) gets 2 in, refused as client_budget_exhausted,
    while another client under the default (10) gets all 4."""
    small = await client_id_of(conn, "small")
    await store.api_client_budget_set(conn, client_id=small, budget_usd_per_day=WORST * Decimal("2.5"))
    big = await client_id_of(conn, "big")
    default = WORST * 10
    assert await _admit(conn, small, 4, client_budget=default) == ["inserted"] * 2 + ["client_budget_exhausted"] * 2
    assert await _admit(conn, big, 4, client_budget=default) == ["inserted"] * 4


async def test_each_way_a_job_ends_settles_its_reservation_once(conn: psycopg.AsyncConnection[Any]) -> None:
    """Completed: charged its story's cost. Failed unbilled: nothing. Cancelled pending: nothing.
    Cancelled running (its call's end unknown): its worst case, until its worker closes the stream and
    brings it down to what the stream cost. The reservations all go, and a second cancel changes nothing."""
    client = await client_id_of(conn)
    budget = WORST * 10
    assert await _admit(conn, client, 4, budget=budget) == ["inserted"] * 4
    completed, failed, running = await _claim(conn, 3)
    await worker_statements.job_settle(conn, worker_id="w", completions=[Completion(job_id=completed, client_id=client, attempt=1, title="T",
                                                             body="B", model="m", prompt_version="v",
                                                             input_tokens=5, output_tokens=50,
                                                             cost_usd=Decimal("0.000510"))])
    await worker_statements.job_fail_running(conn, worker_id="w", failures=[Failure(
        job_id=failed, attempt=1, error_code=ErrorCode.LLM_UNAVAILABLE, error_text="429s",
        call_outcome=LlmOutcome.RATE_LIMITED, billed=False)])
    cur = await conn.execute("SELECT public_id FROM story_jobs WHERE id IN (%s, 4) ORDER BY id", (running,))
    running_public, pending_public = [row[0] for row in await cur.fetchall()]
    for public_id in (running_public, pending_public, running_public):
        await ApiStore(conn).job_cancel(client_id=client, job_id=public_id)
    assert await _day(conn) == (Decimal("0.000510") + WORST, Decimal(0))
    # the cancelled job's worker closes its stream and says what it cost
    await worker_statements.llm_call_finish(conn, model="m", job_id=running, attempt=1, outcome=LlmOutcome.STOPPED, billed=True,
                                input_tokens=5, output_tokens=20, cost_usd=Decimal("0.000210"),
                                error_text="stream stopped: job cancelled")
    assert await _day(conn) == (Decimal("0.000720"), Decimal(0))
    assert await _day(conn, client) == (Decimal("0.000720"), Decimal(0))


async def test_the_sweeper_charges_a_dead_workers_job_its_worst_case_and_a_stale_pending_job_nothing(
    conn: psycopg.AsyncConnection[Any]
) -> None:
    """A running job whose worker is gone may have cost anything up to its worst case, so that is what it
    is charged; a job that waited too long never ran and costs nothing."""
    from datetime import UTC, datetime, timedelta

    client = await client_id_of(conn)
    assert await _admit(conn, client, 2, budget=WORST * 10) == ["inserted"] * 2
    await _claim(conn, 1)
    later = datetime.now(UTC) + timedelta(hours=2)
    swept = await PgSweeperStore(conn).fail_stale(heartbeat_timeout_s=60, job_timeout_s=480, pending_timeout_s=1800,
                                                  judge_running=True, batch_size=10, lock_timeout_s=5, now=later)
    assert sorted(job.reason for job in swept) == ["queue_timeout", "timed_out"]
    assert await _day(conn) == (WORST, Decimal(0))


async def test_concurrent_admissions_never_pass_the_budget(database_url: str, conn: psycopg.AsyncConnection[Any]) -> None:
    """20 connections admitting at once against a budget of 7.5 worst cases: exactly 7 admitted, and
    spent + reserved at most the budget."""
    client = await client_id_of(conn)
    budget = WORST * Decimal("7.5")

    async def one() -> str:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            (outcome,) = await _admit(c, client, 1, budget=budget)
            return outcome

    outcomes = await asyncio.gather(*(one() for _ in range(20)))
    assert outcomes.count("inserted") == 7
    spent, reserved = await _day(conn)
    assert spent + reserved == WORST * 7 <= budget


@pytest.mark.parametrize("limited", [False, True])
async def test_a_worker_store_fails_jobs_and_gives_back_their_tokens(
    pool: Any, conn: psycopg.AsyncConnection[Any], limited: bool
) -> None:
    """Failing a job through the worker's store charges it nothing when unbilled, with or without a rate
    limit configured."""
    from shared.ratelimit import NO_LIMITS, RateLimits

    client = await client_id_of(conn)
    assert await _admit(conn, client, 1, budget=WORST * 10) == ["inserted"]
    limits = (RateLimits(1.0, 10.0, None, None, 1000.0, 10_000.0) if limited else NO_LIMITS)
    worker_store = PgWorkerStore(pool, worker_id="w", provider="anthropic", model="m", default_max_tokens=4000)
    await worker_store.ensure_rate_bucket(limits)
    claim = (await worker_store.settle_and_claim([], ClaimAsk(1), limits)).claimed
    assert claim is not None
    (job,) = claim.claimed
    assert await worker_store.fail_running([Failure(job_id=job.id, attempt=1, error_code=ErrorCode.LLM_REJECTED,
                                                    error_text="400", call_outcome=LlmOutcome.REJECTED,
                                                    billed=False)], limits) == [job.id]
    assert await _day(conn) == (Decimal(0), Decimal(0))
    if limited:
        cur = await conn.execute("SELECT output_tokens FROM llm_rate_buckets")
        row = await cur.fetchone()
        assert row is not None and row[0] == pytest.approx(10_000, abs=1)


async def _seconds_to_midnight_utc(conn: psycopg.AsyncConnection[Any]) -> float:
    """How long until the UTC day ends, by the database's clock."""
    (now,) = await (await conn.execute("SELECT now()")).fetchone() or (None,)
    assert isinstance(now, datetime)
    midnight = datetime.combine(now.astimezone(UTC).date() + timedelta(days=1), time(), tzinfo=UTC)
    return (midnight - now).total_seconds()


async def test_a_story_over_the_budget_is_told_to_retry_at_midnight_utc_by_the_databases_clock(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, api_key: str,
) -> None:
    """A POST refused for the spend budget answers 429 budget-exhausted with Retry-After the seconds left until
    the budget's day ends, midnight UTC by the database's clock, rounded up: neither sooner, when the budget
    still has no room, nor later."""
    async with api_client(pool, api_key, budget_usd_per_day=Decimal("0.000001")) as client:
        before = await _seconds_to_midnight_utc(conn)
        answer = await client.post("/stories/generate", json={"prompt": "a fox"}, headers=new_key())
        after = await _seconds_to_midnight_utc(conn)
    assert assert_problem(answer, 429)["type"] == "/problems/budget-exhausted"
    assert math.ceil(after) <= int(answer.headers["retry-after"]) <= math.ceil(before)
