"""The turns admission gives stay right whatever a client does: one that keeps
its queue full, one that cancels queued jobs and sends them again (the turns
are given back), and the operator's cancellation of a client's pending jobs.
The claims are the worker's statement, the admissions the api's."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import psycopg

from api.admission import admission
from api.store import ApiStore
from shared.config import ApiSettings
from shared.story_request import StoryRequest
from tests.support import worker_statements
from tests.support.database import cancel_pending_in_bulk, client_id_of


async def _post(conn: psycopg.AsyncConnection[Any], client: int, jobs: int = 1, *, client_queue_max: int = 1_000,
                ) -> list[uuid.UUID]:
    """The api's admission of ``jobs`` new requests of a client, one batch; the ids of those admitted."""
    batch = [admission(client, uuid.uuid4().hex, StoryRequest(prompt="a fox"), ApiSettings()) for _ in range(jobs)]
    results = await ApiStore(conn).job_insert_if_admitted(admissions=batch, queue_max=1_000,
                                                          client_queue_max=client_queue_max)
    return [r.public_id for r in results if r.outcome == "inserted" and r.public_id is not None]


async def _claim(conn: psycopg.AsyncConnection[Any]) -> int:
    """One claim of one job by the worker's statement; the client whose job it took."""
    result = await worker_statements.job_claim(conn, worker_id="w", claim_limit=1,
                                              provider="anthropic", model="m")
    (job,) = result.claimed
    return job.client_id


async def _pending(conn: psycopg.AsyncConnection[Any], client: int) -> int:
    cur = await conn.execute("SELECT count(*) FROM story_jobs WHERE status = 'pending' AND client_id = %s", (client,))
    (n,) = await cur.fetchone() or (0,)
    return int(n)


async def test_a_client_that_refills_its_full_queue_at_once_shares_the_claims(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """A client at CLIENT_QUEUE_MAX=3 that sends a job the moment a slot frees, and another that sends 3:
    the next 12 claims go 6 and 6, not all but one to the first."""
    greedy, polite = await client_id_of(conn, "greedy"), await client_id_of(conn, "polite")
    assert len(await _post(conn, greedy, 3, client_queue_max=3)) == 3
    for _ in range(5):
        await _claim(conn)
        assert len(await _post(conn, greedy, client_queue_max=3)) == 1
    assert len(await _post(conn, polite, 3, client_queue_max=3)) == 3
    claims = []
    for _ in range(12):
        claims.append(await _claim(conn))
        for client in (greedy, polite):
            await _post(conn, client, 3 - await _pending(conn, client), client_queue_max=3)
    assert Counter(claims) == {greedy: 6, polite: 6}, claims


async def test_a_client_that_cancels_its_last_jobs_and_sends_them_again_keeps_its_place(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """A client that cancels the last 2 of its 3 queued jobs and sends 2 new ones gets the turns back:
    the first 6 claims go 3 and 3 with a client that queued 10."""
    busy, fickle = await client_id_of(conn, "busy"), await client_id_of(conn, "fickle")
    await _post(conn, busy, 10)
    mine = await _post(conn, fickle, 3)
    for job_id in mine[1:]:
        result = await ApiStore(conn).job_cancel(client_id=fickle, job_id=job_id)
        assert result is not None and result.cancelled
    assert len(await _post(conn, fickle, 2)) == 2
    claims = [await _claim(conn) for _ in range(6)]
    assert Counter(claims) == {busy: 3, fickle: 3}, claims


async def test_a_job_cancelled_in_the_middle_of_a_queue_moves_the_later_ones_up(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """A client that cancels the second of its 3 queued jobs has its third served in the second's turn:
    the first 4 claims go 2 and 2 with a client that queued 10."""
    busy, fickle = await client_id_of(conn, "busy"), await client_id_of(conn, "fickle")
    await _post(conn, busy, 10)
    mine = await _post(conn, fickle, 3)
    result = await ApiStore(conn).job_cancel(client_id=fickle, job_id=mine[1])
    assert result is not None and result.cancelled
    claims = [await _claim(conn) for _ in range(4)]
    assert Counter(claims) == {busy: 2, fickle: 2}, claims


async def test_an_operator_cancelling_a_clients_pending_jobs_gives_their_turns_back(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """After the console cancels all 4 pending jobs of a client, the 4 it sends again take the same turns:
    the first 8 claims go 4 and 4 with a client that queued 10."""
    busy, fickle = await client_id_of(conn, "busy"), await client_id_of(conn, "fickle")
    await _post(conn, busy, 10)
    await _post(conn, fickle, 4)
    cancelled = await cancel_pending_in_bulk(conn, fickle)
    assert len(cancelled) == 4
    assert len(await _post(conn, fickle, 4)) == 4
    claims = [await _claim(conn) for _ in range(8)]
    assert Counter(claims) == {busy: 4, fickle: 4}, claims

