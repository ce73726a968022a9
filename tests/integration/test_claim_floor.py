"""The claim's floor (migration 030): the turn the claim's walk starts at,
raised by the sweeper to the smallest pending turn under the admission lock.
No pending job is ever below it, whatever admission is in flight while it
is raised; and with it raised, a snapshot held open no longer makes each
claim walk every job claimed since the snapshot was taken."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest

from api.admission import admission
from api.store import ApiStore, _requests
from shared.config import ApiSettings
from shared.keys import prefix_of
from shared.ratelimit import NO_LIMITS, claim_params
from shared.story_request import StoryRequest
from sweeper.store import PgSweeperStore
from tests.support import worker_statements
from tests.support.database import (
    claim_floor,
    client_id_of,
    create_key,
    pages_read,
    waiting_on_a_lock,
)
from tests.support.waiting import wait_until


async def _claim(conn: psycopg.AsyncConnection[Any]) -> uuid.UUID:
    (job,) = (await worker_statements.job_claim(conn, worker_id="w", claim_limit=1, provider="anthropic",
                                                model="m")).claimed
    return job.public_id


async def _post(conn: psycopg.AsyncConnection[Any], client: int, jobs: int = 1) -> list[uuid.UUID]:
    batch = [admission(client, uuid.uuid4().hex, StoryRequest(prompt="a fox"), ApiSettings()) for _ in range(jobs)]
    results = await ApiStore(conn).job_insert_if_admitted(admissions=batch, queue_max=100_000,
                                                          client_queue_max=100_000)
    return [r.public_id for r in results if r.public_id is not None]


async def _floor_version(conn: psycopg.AsyncConnection[Any]) -> str:
    """The transaction that wrote the floor's row as it is."""
    cur = await conn.execute("SELECT xmin::text FROM job_claim_floor")
    row = await cur.fetchone()
    assert row is not None
    return str(row[0])


async def _turn(conn: psycopg.AsyncConnection[Any], job: uuid.UUID) -> float:
    cur = await conn.execute("SELECT turn FROM story_jobs WHERE public_id = %s", (job,))
    row = await cur.fetchone()
    assert row is not None
    return float(row[0])


async def test_the_floor_waits_for_an_admission_in_flight_and_stays_at_its_jobs_turn(
    conn: psycopg.AsyncConnection[Any], database_url: str,
) -> None:
    """Client a's jobs have turns 0 and 1. Client b's admission, under the admission lock, gives its job turn
    0 (the turn being served) and has not committed when a's turn-0 job is claimed. Read then, the smallest
    pending turn is 1: the advance must wait for b's admission, and the floor stays at 0, so b's job is the
    next claimed, before a's turn-1 job."""
    first, later = await client_id_of(conn, "first"), await client_id_of(conn, "later")
    a0, a1 = await _post(conn, first, 2)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as admitting, \
            await psycopg.AsyncConnection.connect(database_url, autocommit=True) as sweeping:
        async with admitting.transaction():
            (b0,) = await _post(admitting, later)
            assert await _turn(admitting, b0) == await _turn(conn, a0) == 0.0
            assert await _claim(conn) == a0
            advance = asyncio.create_task(PgSweeperStore(sweeping).advance_claim_floor(lock_timeout_s=30))
            await wait_until(lambda: waiting_on_a_lock(conn), timeout=10,
                             what="the advance waiting for the admission lock an admission holds")
            assert not advance.done()
        assert await advance == 0.0
    assert await claim_floor(conn) == 0.0
    assert [await _claim(conn), await _claim(conn)] == [b0, a1]


async def test_an_advance_that_does_not_get_the_admission_lock_in_time_changes_nothing_and_says_so(
    conn: psycopg.AsyncConnection[Any], database_url: str,
) -> None:
    """An admission holding the lock past the advance's lock timeout: the advance answers None (the pass goes
    on, the next one advances), its transaction rolled back, and its connection serves the next advance."""
    client = await client_id_of(conn)
    (job,) = await _post(conn, client)
    sweeper = PgSweeperStore(conn)
    version = await _floor_version(conn)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as admitting, \
            admitting.transaction():
        await _post(admitting, client)
        assert await sweeper.advance_claim_floor(lock_timeout_s=0.05) is None
        assert await _floor_version(conn) == version
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert await sweeper.advance_claim_floor(lock_timeout_s=5) == await _turn(conn, job)


async def test_the_floor_rises_to_the_smallest_pending_turn_and_with_none_to_where_the_last_turn_ends(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """Raised over the claims, never past a pending job; with nothing pending, to the end of the last turn
    given, which is where the next admission's turn starts."""
    sweeper = PgSweeperStore(conn)
    client = await client_id_of(conn)
    jobs = await _post(conn, client, 3)
    assert await claim_floor(conn) == float("-inf")
    assert await sweeper.advance_claim_floor(lock_timeout_s=5) == 0.0
    assert await _claim(conn) == jobs[0]
    assert await sweeper.advance_claim_floor(lock_timeout_s=5) == 1.0
    await _claim(conn)
    await _claim(conn)
    assert await sweeper.advance_claim_floor(lock_timeout_s=5) == 3.0
    # an advance that finds the floor where it is writes nothing: the row has one version a move
    written = await _floor_version(conn)
    assert await sweeper.advance_claim_floor(lock_timeout_s=5) == 3.0
    assert await _floor_version(conn) == written
    (later,) = await _post(conn, client)
    assert await _turn(conn, later) == 3.0
    assert await _claim(conn) == later


async def test_the_floor_never_moves_back(conn: psycopg.AsyncConnection[Any]) -> None:
    """A cancelled job's turn given back moves its client's later jobs down to that turn, never below the
    floor; an advance then finds the same floor, and every job is still claimed, in turn."""
    sweeper = PgSweeperStore(conn)
    client, other = await client_id_of(conn, "client"), await client_id_of(conn, "other")
    mine = await _post(conn, client, 4)
    theirs = await _post(conn, other, 1)
    assert await _claim(conn) == mine[0]
    assert await sweeper.advance_claim_floor(lock_timeout_s=5) == 0.0
    cancelled = await ApiStore(conn).job_cancel(client_id=client, job_id=mine[1])
    assert cancelled is not None and cancelled.cancelled
    assert await _turn(conn, mine[2]) == 1.0
    assert await sweeper.advance_claim_floor(lock_timeout_s=5) == 0.0
    assert [await _claim(conn) for _ in range(3)] == [theirs[0], mine[2], mine[3]]


async def test_a_pending_interactive_job_without_a_turn_is_refused(conn: psycopg.AsyncConnection[Any]) -> None:
    """The walk from the floor would never reach it."""
    (job,) = await _post(conn, await client_id_of(conn))
    with pytest.raises(psycopg.errors.CheckViolation, match="story_jobs_pending_has_turn"):
        await conn.execute("UPDATE story_jobs SET turn = NULL WHERE public_id = %s", (job,))


async def test_under_a_held_snapshot_each_walk_of_the_turns_reads_only_what_was_claimed_since_the_floor_rose(
    conn: psycopg.AsyncConnection[Any], database_url: str,
) -> None:
    """With a snapshot held open, each job claimed leaves its entry in the claim's index for every later walk
    of it: the claim's, the turn an admission gives, a poll's queue position, the floor's advance. Once the
    floor rises past them, each reads what it read before them."""
    client = await client_id_of(conn, "poller")
    key = await create_key(conn, "poller")
    # the polled job is the last: its queue position counts every pending job
    *_, polled = await _post(conn, client, 2_500)
    statements = {
        "job_claim": {**claim_params(NO_LIMITS, None, default_max_tokens=4000), "worker_id": "probe",
                      "claim_limit": 1, "provider": "anthropic", "model": "m"},
        "job_insert_if_admitted": {
            "requests": _requests([admission(client, "probe", StoryRequest(prompt="a fox"), ApiSettings())]),
            "queue_max": 100_000, "client_queue_max": 100_000, "batch_queue_max": 10_000,
            "client_batch_queue_max": 5_000, "budget_usd": None, "client_budget_usd": None},
        "job_get_for_key": {"key_prefix": prefix_of(key), "job_id": polled, "since": 0},
        # the advance's own walk: from the floor it raises, so a pass reads what was claimed since the last
        "job_claim_floor_advance": {},
    }
    under_the_admission_lock = {"job_insert_if_admitted", "job_claim_floor_advance"}

    async def reads() -> dict[str, int]:
        return {name: await pages_read(conn, name, params, admission_lock=name in under_the_admission_lock)
                for name, params in statements.items()}

    await PgSweeperStore(conn).advance_claim_floor(lock_timeout_s=5)
    await conn.execute("VACUUM story_jobs")
    fresh = await reads()
    async with await psycopg.AsyncConnection.connect(database_url) as holder:
        await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await holder.execute("SELECT count(*) FROM api_clients")
        for _ in range(2_000):
            await _claim(conn)
        walked = await reads()
        await PgSweeperStore(conn).advance_claim_floor(lock_timeout_s=5)
        after = await reads()
        await holder.rollback()
    for name in statements:
        assert walked[name] > fresh[name] + 60, (name, fresh, walked)
        assert after[name] <= fresh[name] + 10, (name, fresh, walked, after)


async def test_admission_and_the_poll_find_their_turns_from_the_floor(conn: psycopg.AsyncConnection[Any]) -> None:
    """The turn being served and a job's queue position, read from a risen floor: as they were before."""
    first = await client_id_of(conn, "first")
    await _post(conn, first, 5)
    for _ in range(3):
        await _claim(conn)
    assert await PgSweeperStore(conn).advance_claim_floor(lock_timeout_s=5) == 3.0
    key = await create_key(conn, "second")
    (job,) = await _post(conn, await client_id_of(conn, "second"))
    assert await _turn(conn, job) == 3.0
    polled = await ApiStore(conn).job_get_for_key(key_prefix=prefix_of(key) or "", job_id=job)
    assert polled is not None and polled.job is not None
    # first's turn-3 job is ahead of it (the older job in the same turn), its turn-4 job behind
    assert polled.job.queue_position == 2
