"""The claim's fair share on a real Postgres: clients with pending jobs are served
in turn, weighted, oldest first within a client, whichever claimers interleave;
and under a rate limit a job the bucket does not cover neither blocks the jobs
behind it nor is starved by them."""

from __future__ import annotations

from collections import Counter
from typing import Any

import psycopg
import pytest

from shared import store
from shared.ratelimit import NO_LIMITS, RateLimits
from tests.support import worker_statements
from tests.support.database import client_id_of, enqueue

MODEL = "m"


async def _claim(conn: psycopg.AsyncConnection[Any], worker_id: str, limit: int,
                 limits: RateLimits = NO_LIMITS) -> list[int]:
    result = await worker_statements.job_claim(conn, worker_id=worker_id, claim_limit=limit, provider="anthropic",
                                               model=MODEL, limits=limits, default_max_tokens=1000)
    return [job.id for job in result.claimed]


async def _clients_of(conn: psycopg.AsyncConnection[Any], job_ids: list[int]) -> list[int]:
    cur = await conn.execute("SELECT client_id FROM story_jobs WHERE id = ANY (%s) ORDER BY array_position(%s, id)",
                             (job_ids, job_ids))
    return [row[0] for row in await cur.fetchall()]


async def _queue(conn: psycopg.AsyncConnection[Any], client: int, jobs: int) -> None:
    for n in range(jobs):
        await enqueue(conn, client, f"story {n}")


async def _weight(conn: psycopg.AsyncConnection[Any], client: int, weight: int) -> None:
    await store.api_client_weight_set(conn, client_id=client, weight=weight)


async def test_a_client_with_a_long_queue_shares_the_claims_with_those_who_come_later(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """A client with 30 queued jobs, then two clients with 5 each: the claims go round the three
    clients, each client's jobs oldest first."""
    heavy, b, c = [await client_id_of(conn, name) for name in ("heavy", "b", "c")]
    await _queue(conn, heavy, 30)
    await _queue(conn, b, 5)
    await _queue(conn, c, 5)
    claimed = [job for _ in range(15) for job in await _claim(conn, "w", 1)]
    clients = await _clients_of(conn, claimed)
    for n in range(0, 15, 3):
        assert sorted(clients[n:n + 3]) == sorted([heavy, b, c]), clients
    for client in (heavy, b, c):
        mine = [job for job, owner in zip(claimed, clients, strict=True) if owner == client]
        assert mine == sorted(mine)  # oldest first within a client


async def test_a_client_of_weight_two_gets_two_claims_to_the_others_one(conn: psycopg.AsyncConnection[Any]) -> None:
    """With weights 1, 2 and 1 and 20 jobs queued by each, the first 20 claims go 5, 10 and 5."""
    a, b, c = [await client_id_of(conn, name) for name in ("a", "b", "c")]
    await _weight(conn, b, 2)
    for client in (a, b, c):
        await _queue(conn, client, 20)
    claimed = [job for _ in range(5) for job in await _claim(conn, "w", 4)]
    shares = Counter(await _clients_of(conn, claimed))
    assert shares == {a: 5, b: 10, c: 5}


async def test_a_client_back_from_idle_gets_its_turn_but_no_credit(conn: psycopg.AsyncConnection[Any]) -> None:
    """A client whose jobs were all served long ago and who comes back while another client has 40
    queued goes round with it from then on: every other claim, not all its jobs at once."""
    busy, back = [await client_id_of(conn, name) for name in ("busy", "back")]
    await _queue(conn, back, 3)
    await _queue(conn, busy, 40)
    assert len([job for _ in range(10) for job in await _claim(conn, "w", 1)]) == 10
    await _queue(conn, back, 10)
    clients = await _clients_of(conn, [job for _ in range(10) for job in await _claim(conn, "w", 1)])
    assert Counter(clients) == {busy: 5, back: 5}
    assert all(clients[n] != clients[n + 1] for n in range(9)), clients


@pytest.mark.parametrize("first_commits", [True, False], ids=["first-commits", "first-rolls-back"])
async def test_claimers_interleaved_take_the_turns_in_order(
    database_url: str, conn: psycopg.AsyncConnection[Any], first_commits: bool
) -> None:
    """A claimer holding its claim uncommitted while a second claims, then an admission, then a third
    claim: together they take the weighted turns in order, and turns a rolled-back claim held are the
    next ones taken."""
    a, b = [await client_id_of(conn, name) for name in ("a", "b")]
    await _weight(conn, b, 3)
    await _queue(conn, a, 12)
    await _queue(conn, b, 12)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as first:
        async with first.transaction(force_rollback=not first_commits):
            held = await _claim(first, "w1", 4)
            second = await _claim(conn, "w2", 4)
        late = await client_id_of(conn, "late")
        await _queue(conn, late, 4)
        third = await _claim(conn, "w3", 8)
    assert Counter(await _clients_of(conn, held)) == {a: 1, b: 3}
    assert Counter(await _clients_of(conn, second)) == {a: 1, b: 3}
    if first_commits:
        # the late client goes round with a and b at once, not after their queues
        assert Counter(await _clients_of(conn, third)) == {a: 2, b: 4, late: 2}
    else:
        assert set(held) <= set(third) and late in await _clients_of(conn, third)


# one request in ten minutes: no test sees a refill; the tokens are set per test
LIMITS = RateLimits(requests_rate=1e-3, requests_capacity=10.0, input_tokens_rate=None, input_tokens_capacity=None,
                    output_tokens_rate=1e-3, output_tokens_capacity=8000.0, burst_s=5.0)


async def _limited_claim(conn: psycopg.AsyncConnection[Any], limit: int) -> list[int]:
    return await _claim(conn, "w", limit, LIMITS)


async def _jobs_needing(conn: psycopg.AsyncConnection[Any], *output_tokens: int) -> list[int]:
    client = await client_id_of(conn)
    await _queue(conn, client, len(output_tokens))
    cur = await conn.execute("SELECT id FROM story_jobs WHERE status = 'pending' ORDER BY turn, id")
    ids = [row[0] for row in await cur.fetchall()]
    for job_id, need in zip(ids, output_tokens, strict=True):
        await conn.execute("UPDATE story_jobs SET max_tokens = %s WHERE id = %s", (need, job_id))
    await worker_statements.llm_rate_bucket_ensure(conn, model=MODEL, limits=LIMITS)
    return ids


async def _bucket_holds(conn: psycopg.AsyncConnection[Any], output_tokens: float) -> None:
    await conn.execute("UPDATE llm_rate_buckets SET output_tokens = %s, refilled_at = now() WHERE model = %s",
                       (output_tokens, MODEL))


async def test_a_job_the_bucket_does_not_cover_lets_the_covered_ones_behind_it_go(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """A 6,000-token job at the head and 1,000-token jobs behind it, 2,500 tokens in the bucket: the
    claim takes the two small jobs that fit and leaves the big one pending."""
    big, small1, small2, small3 = await _jobs_needing(conn, 6000, 1000, 1000, 1000)
    await _bucket_holds(conn, 2500)
    assert await _limited_claim(conn, 4) == [small1, small2]
    cur = await conn.execute("SELECT status FROM story_jobs WHERE id IN (%s, %s) ORDER BY id", (big, small3))
    assert [row[0] for row in await cur.fetchall()] == ["pending", "pending"]


async def test_a_job_held_back_a_whole_burst_is_owed_the_bucket_and_goes_first(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """Once the job the bucket does not cover has waited LLM_RATE_BURST_S, the small jobs behind it
    stop passing it; when the bucket covers it, it is claimed first."""
    big, small1, small2, _ = await _jobs_needing(conn, 6000, 1000, 1000, 1000)
    await _bucket_holds(conn, 1500)
    assert await _limited_claim(conn, 4) == [small1]
    # the held-back job has now waited longer than the burst
    await conn.execute("UPDATE llm_rate_buckets SET held_since = now() - interval '6 seconds' WHERE model = %s",
                       (MODEL,))
    await _bucket_holds(conn, 1500)
    assert await _limited_claim(conn, 4) == []
    await _bucket_holds(conn, 7000)
    assert await _limited_claim(conn, 4) == [big, small2]
