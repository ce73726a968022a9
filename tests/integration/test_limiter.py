"""The shared rate bucket in the claim statement, on a real Postgres: it covers
exactly what it holds, however many claimers race for it, in either order, and
gets back what finished calls did not use."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

import msgspec
import psycopg
import pytest

from shared.console_store import ConsoleStore
from shared.ratelimit import NO_LIMITS, RateLimits
from shared.status import LlmOutcome
from tests.support import worker_statements
from tests.support.database import client_id_of, count, enqueue, waiting_on_a_lock
from tests.support.waiting import wait_until
from worker.rows import Completion

MODEL = "m"
# 5 requests and 8,000 output tokens in the bucket, refilling so slowly that
# no test sees a refill
LIMITS = RateLimits(requests_rate=1e-6, requests_capacity=5.0, input_tokens_rate=None, input_tokens_capacity=None,
                    output_tokens_rate=1e-6, output_tokens_capacity=8000.0)


def _claim_kwargs(**overrides: Any) -> dict[str, Any]:
    return {"limits": msgspec.structs.replace(LIMITS, **overrides), "default_max_tokens": 1600}


async def _claim(conn: psycopg.AsyncConnection[Any], worker_id: str, limit: int, **overrides: Any) -> list[int]:
    result = await worker_statements.job_claim(conn, worker_id=worker_id, claim_limit=limit,
                                              provider="anthropic", model=MODEL, **_claim_kwargs(**overrides))
    return [job.id for job in result.claimed]


async def _bucket(conn: psycopg.AsyncConnection[Any]) -> tuple[float, float]:
    cur = await conn.execute("SELECT requests, output_tokens FROM llm_rate_buckets WHERE model = %s", (MODEL,))
    row = await cur.fetchone()
    assert row is not None
    return row[0], row[1]


@pytest.fixture
async def pending(conn: psycopg.AsyncConnection[Any]) -> int:
    """50 pending jobs of 1,600 max_tokens each, and a full bucket."""
    client = await client_id_of(conn)
    for n in range(50):
        await enqueue(conn, client, f"story {n}")
    await worker_statements.llm_rate_bucket_ensure(conn, model=MODEL, limits=LIMITS)
    return client


async def test_sixteen_claimers_on_one_bucket_claim_exactly_what_it_holds(
    database_url: str, conn: psycopg.AsyncConnection[Any], pending: int
) -> None:
    """16 workers claiming at once, 3 slots each: 5 jobs are claimed in all (the bucket's 8,000 output
    tokens cover five of 1,600), each once; the bucket is left at zero, never below."""

    async def claimer(n: int) -> list[int]:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            return await _claim(c, f"w{n}", 3)

    claimed = [job for jobs in await asyncio.gather(*(claimer(n) for n in range(16))) for job in jobs]
    assert len(claimed) == len(set(claimed)) == 5
    requests, output_tokens = await _bucket(conn)
    assert requests == pytest.approx(0, abs=1e-3) and output_tokens == pytest.approx(0, abs=1e-2)
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE status = 'pending'") == 45


@pytest.mark.parametrize("first_commits", [True, False], ids=["first-commits", "first-rolls-back"])
async def test_a_claimer_waiting_on_the_bucket_sees_what_the_first_took(
    database_url: str, conn: psycopg.AsyncConnection[Any], pending: int, first_commits: bool
) -> None:
    """A claim holds the bucket's row until it ends; a second claim waits for it, then reads the bucket
    as the first left it: after a commit what is left, after a rollback all of it."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as first:
        async with first.transaction():
            assert len(await _claim(first, "w1", 4)) == 4
            second = asyncio.create_task(_claim(conn, "w2", 4))
            await wait_until(lambda: waiting_on_a_lock(first), what="the second claim to wait on the bucket")
            if not first_commits:
                raise psycopg.Rollback()  # psycopg rolls the block back and carries on
        claimed_second = await second
    assert len(claimed_second) == (1 if first_commits else 4)
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE status = 'running'") == (5 if first_commits else 4)


async def test_a_job_the_bucket_cannot_cover_stays_pending_and_the_answer_says_what_it_needs(
    conn: psycopg.AsyncConnection[Any], pending: int
) -> None:
    """Asked for 10 with room for 5, the claim takes the five oldest, leaves the rest pending, and says
    what the first job it held back needs, so the worker knows when to try again."""
    result = await worker_statements.job_claim(conn, worker_id="w", claim_limit=10,
                                              provider="anthropic", model=MODEL, **_claim_kwargs())
    assert [job.id for job in result.claimed] == [1, 2, 3, 4, 5]
    assert result.limiter.next_output_tokens == 1600
    assert result.limiter.wait_s(LIMITS) > 60  # at 1e-6 tokens a second: a long wait


async def test_what_a_completed_call_did_not_use_is_given_back(conn: psycopg.AsyncConnection[Any], pending: int) -> None:
    """A story written with 100 of its 1,600 reserved output tokens gives 1,500 back at its completion,
    in the statement that settles it, where the next claim can use them."""
    (job_id,) = await _claim(conn, "w", 1)
    done = Completion(job_id=job_id, client_id=pending, attempt=1, title="T", body="B", model=MODEL,
                      prompt_version="v", input_tokens=10, output_tokens=100, cost_usd=Decimal("0.001"))
    result = await worker_statements.job_settle(conn, worker_id="w", completions=[done], model=MODEL,
                                                limits=LIMITS)
    assert result.completed_ids == [job_id]
    _, output_tokens = await _bucket(conn)
    assert output_tokens == pytest.approx(8000 - 1600 + 1500, abs=1e-2)


async def test_a_pause_holds_every_claim_until_it_ends(conn: psycopg.AsyncConnection[Any], pending: int) -> None:
    """While a 429's pause lasts, a claim takes nothing and says how long it lasts, limit or no limit."""
    await worker_statements.llm_rate_bucket_pause(conn, model=MODEL, pause_s=30)
    for limits in (LIMITS, NO_LIMITS):
        result = await worker_statements.job_claim(conn, worker_id="w", claim_limit=3, provider="anthropic",
                                                   model=MODEL, limits=limits, default_max_tokens=1600)
        assert result.claimed == [] and 25 < result.limiter.paused_s <= 30


async def test_a_deleted_bucket_row_is_recreated_empty_and_claims_nothing_meanwhile(
    conn: psycopg.AsyncConnection[Any], pending: int
) -> None:
    """With a limit configured and the bucket's row gone (an operator's reset), the claim takes nothing
    rather than everything, and writes the row back, empty, to refill from there."""
    await conn.execute("DELETE FROM llm_rate_buckets")
    assert await _claim(conn, "w", 3) == []
    assert await _bucket(conn) == (0.0, 0.0)


async def test_a_retry_after_a_429_takes_its_request_from_the_bucket_like_a_claim(
    conn: psycopg.AsyncConnection[Any], pending: int
) -> None:
    """At one request a second, a retry finding 0.25 of a request in the bucket opens no attempt and is
    told to wait 0.75 s; with 1.5 requests it opens its attempt and leaves 0.5."""
    limits = RateLimits(requests_rate=1.0, requests_capacity=5.0, input_tokens_rate=None, input_tokens_capacity=None,
                        output_tokens_rate=None, output_tokens_capacity=None)
    (job,) = await _claim(conn, "w1", 1)

    async def retry() -> tuple[int | None, float]:
        started = await worker_statements.llm_call_start(conn, worker_id="w1", job_id=job, previous_attempt=1,
                                             previous_outcome=LlmOutcome.RATE_LIMITED, previous_error="429", model=MODEL, limits=limits)
        assert started.owned
        return started.attempt, started.paused_s

    await conn.execute("UPDATE llm_rate_buckets SET requests = 0.25, refilled_at = now() WHERE model = %s", (MODEL,))
    attempt, wait_s = await retry()
    assert attempt is None and wait_s == pytest.approx(0.75, abs=0.05)
    await conn.execute("UPDATE llm_rate_buckets SET requests = 1.5, refilled_at = now() WHERE model = %s", (MODEL,))
    attempt, wait_s = await retry()
    assert attempt == 2 and wait_s == 0
    requests, _ = await _bucket(conn)
    assert requests == pytest.approx(0.5, abs=0.05)


async def test_a_claim_without_a_limit_learns_the_limits_a_limited_round_paced_by(
    conn: psycopg.AsyncConnection[Any], pending: int
) -> None:
    """A worker that knows no limit yet, after another's limited round left the bucket unpaused
    ('-infinity'): its claim claims nothing, is held back, and answers the limits per minute to pace
    by from then on."""
    assert len(await _claim(conn, "w1", 1)) == 1
    result = await worker_statements.job_claim(conn, worker_id="w2", claim_limit=2,
                                              provider="anthropic", model=MODEL)
    assert result.claimed == [] and result.limiter.paused_s == 0
    assert result.limiter.next_output_tokens is not None
    assert LIMITS.requests_rate is not None
    assert result.limiter.requests_per_minute == pytest.approx(LIMITS.requests_rate * 60)
    assert result.limiter.input_tokens_per_minute is None


async def test_a_429_leaves_the_bucket_one_request_for_the_end_of_its_pause(
    conn: psycopg.AsyncConnection[Any], pending: int
) -> None:
    """At one request a second, a 429 with a 2 s retry-after lowers a full bucket so that, refilled, it
    holds one request when the pause ends (-1 now); without a known rate the bucket is left alone."""
    await conn.execute("UPDATE llm_rate_buckets SET requests = 5, refilled_at = now() WHERE model = %s", (MODEL,))
    await worker_statements.llm_rate_bucket_pause(conn, model=MODEL, pause_s=2.0, limits=RateLimits(
        requests_rate=1.0, requests_capacity=5.0, input_tokens_rate=None, input_tokens_capacity=None,
        output_tokens_rate=None, output_tokens_capacity=None))
    requests, _ = await _bucket(conn)
    assert requests == pytest.approx(-1.0, abs=0.1)
    await worker_statements.llm_rate_bucket_pause(conn, model=MODEL, pause_s=2.0)
    assert (await _bucket(conn))[0] == requests


async def test_a_retry_waits_for_its_max_tokens_in_the_bucket_and_takes_them(
    conn: psycopg.AsyncConnection[Any], pending: int
) -> None:
    """With only an output-token limit (1,000 a second), a retry of a 1,600-token job finding 600 in the
    bucket waits 1 s; with 2,000 it opens and takes the 1,600 (the provider takes them again)."""
    limits = RateLimits(requests_rate=None, requests_capacity=None, input_tokens_rate=None,
                        input_tokens_capacity=None, output_tokens_rate=1000.0, output_tokens_capacity=8000.0)
    (job,) = await _claim(conn, "w1", 1)

    async def retry() -> tuple[int | None, float]:
        started = await worker_statements.llm_call_start(conn, worker_id="w1", job_id=job, previous_attempt=1,
                                             previous_outcome=LlmOutcome.RATE_LIMITED, previous_error="429", model=MODEL, limits=limits)
        return started.attempt, started.paused_s

    await conn.execute("UPDATE llm_rate_buckets SET output_tokens = 600, refilled_at = now() WHERE model = %s",
                       (MODEL,))
    attempt, wait_s = await retry()
    assert attempt is None and wait_s == pytest.approx(1.0, abs=0.05)
    await conn.execute("UPDATE llm_rate_buckets SET output_tokens = 2000, refilled_at = now() WHERE model = %s",
                       (MODEL,))
    assert (await retry())[0] == 2
    assert (await _bucket(conn))[1] == pytest.approx(400, abs=50)


async def _held_back(conn: psycopg.AsyncConnection[Any], worker_id: str, limit: int) -> tuple[int, bool, float]:
    result = await worker_statements.job_claim(conn, worker_id=worker_id, claim_limit=limit,
                                                     provider="anthropic", model=MODEL, **_claim_kwargs())
    return len(result.claimed), result.limiter.waker, result.limiter.waker_in_s


async def test_of_the_workers_held_back_one_wakes_for_the_bucket_and_the_others_after_its_role_ends(
    conn: psycopg.AsyncConnection[Any], pending: int
) -> None:
    """The first worker held back with a slot still free becomes the bucket's waker for the bucket's
    burst (5 s); a second one held back is told when that role ends and that it is not the waker;
    the waker keeps the role round after round, and once the role is overdue the second takes it."""
    claimed, waker, waker_in_s = await _held_back(conn, "w1", 10)
    assert (claimed, waker) == (5, True) and waker_in_s == pytest.approx(5.0, abs=0.5)
    claimed, waker, waker_in_s = await _held_back(conn, "w2", 3)
    assert (claimed, waker) == (0, False) and 4.0 < waker_in_s <= 5.0
    assert (await _held_back(conn, "w1", 3))[1] is True
    await conn.execute("UPDATE llm_rate_buckets SET waker_until = now() - interval '1 ms' WHERE model = %s", (MODEL,))
    assert (await _held_back(conn, "w2", 3))[1] is True
    assert (await _held_back(conn, "w1", 3))[:2] == (0, False)


async def test_a_round_that_only_settles_leaves_the_waker_its_role(
    conn: psycopg.AsyncConnection[Any], pending: int
) -> None:
    """The waker's own rounds with no slot to claim with (it settles finished stories while it waits for the
    bucket) keep its role: the next worker held back is still told to wait for it."""
    assert (await _held_back(conn, "w1", 10))[1] is True
    assert (await _held_back(conn, "w1", 0))[:2] == (0, True)
    assert (await _held_back(conn, "w2", 3))[:2] == (0, False)


async def test_a_waker_that_takes_its_last_free_slot_gives_the_role_up(
    conn: psycopg.AsyncConnection[Any], pending: int
) -> None:
    """A waker whose claim fills its last slot would not come back for the bucket: it leaves the role
    free, and the next worker held back takes it at once."""
    assert (await _held_back(conn, "w1", 10))[1] is True
    await conn.execute("UPDATE llm_rate_buckets SET requests = 2, output_tokens = 3200, refilled_at = now() "
                       "WHERE model = %s", (MODEL,))
    assert await _held_back(conn, "w1", 2) == (2, False, 0.0)
    assert (await _held_back(conn, "w2", 3))[:2] == (0, True)


async def test_a_worker_not_held_back_takes_no_role(conn: psycopg.AsyncConnection[Any], pending: int) -> None:
    """A claim the bucket covers whole (its slots filled, nothing it wanted held back) leaves the role
    free: only a worker that will come back for the bucket is its waker."""
    assert (await _held_back(conn, "w1", 3))[:2] == (3, False)
    assert (await _held_back(conn, "w2", 10))[:2] == (2, True)


async def test_the_console_reads_the_bucket_as_the_claim_refills_it(
    conn: psycopg.AsyncConnection[Any], pending: int
) -> None:
    """A bucket row a pause wrote 2 s ago, before its request rate was known (no requests stored), holds what 2 s
    of refill give at one request a second: the console reads 2 of them, and a claim asking for 5 takes 2."""
    limits = RateLimits(requests_rate=1.0, requests_capacity=5.0, input_tokens_rate=None, input_tokens_capacity=None,
                        output_tokens_rate=LIMITS.output_tokens_rate, output_tokens_capacity=LIMITS.output_tokens_capacity)
    await conn.execute("UPDATE llm_rate_buckets SET requests = NULL, refilled_at = now() - interval '2 s' "
                       "WHERE model = %s", (MODEL,))
    (bucket,) = await ConsoleStore(conn).stats.llm_rate_bucket_list(limits=limits)
    assert bucket.requests == pytest.approx(2.0, abs=0.1)
    assert len(await _claim(conn, "w", 5, requests_rate=1.0, requests_capacity=5.0)) == 2
