"""The stories' partitions (migration 029, sweeper/partitions.py): bounded, kept ahead of the ids, dropped
whole once every job of their range is pruned, and never the reason a story is refused or lost."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from api.rows import StoryView
from shared import keys
from shared.store import fetch_all, fetch_one
from sweeper import partitions
from sweeper.store import PgSweeperStore
from tests.support import ops_seed
from tests.support.api_client import api_client
from tests.support.database import count
from tests.support.settings import worker_settings
from tests.support.waiting import wait_until
from tests.support.workers import running_worker

DAY = 86400.0
RETENTION_S = 30 * DAY


@pytest.fixture
async def client(pool: AsyncConnectionPool, api_key: str) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(pool, api_key) as test_client:
        yield test_client


async def _ranges(conn: psycopg.AsyncConnection[Any]) -> list[tuple[str, int, Any]]:
    """(name, lo, hi) of each ranged partition, lowest first; hi None for stories_ahead."""
    cur = await conn.execute("SELECT name, lo, hi FROM story_partition_ranges ORDER BY lo")
    return list(await cur.fetchall())


async def _partition_of(conn: psycopg.AsyncConnection[Any], job_id: int) -> str:
    cur = await conn.execute("SELECT tableoid::regclass::text FROM stories WHERE job_id = %s", (job_id,))
    row = await cur.fetchone()
    assert row is not None, f"no story for job {job_id}"
    return str(row[0])


async def _next_id_at(conn: psycopg.AsyncConnection[Any], job_id: int) -> None:
    await conn.execute("SELECT setval(pg_get_serial_sequence('story_jobs', 'id'), %s)", (job_id - 1,))


async def _seed(conn: psycopg.AsyncConnection[Any], jobs: list[ops_seed.Job]) -> list[ops_seed.Job]:
    return await ops_seed.insert_jobs(conn, jobs)


async def _served(conn: psycopg.AsyncConnection[Any], key: str, job: ops_seed.Job) -> Any:
    """The story of ``job`` as GET /stories/{story_id} reads it (story_get_for_key), or None."""
    cur = await conn.execute("SELECT story_id FROM story_jobs WHERE id = %s", (job.id,))
    (story_id,) = await cur.fetchone() or (None,)
    row = await fetch_one(conn, StoryView, "story_get_for_key",
                          {"key_prefix": keys.prefix_of(key), "story_id": story_id})
    assert row is not None
    return None if row.story is None else msgspec.to_builtins(row.story)


async def _keep(pool: AsyncConnectionPool) -> partitions.StoryPartitionsKept:
    return await PgSweeperStore(pool).keep_story_partitions(retention_s=RETENTION_S)


async def test_the_first_pass_bounds_the_old_table_and_keeps_ranges_ahead_of_the_ids(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    """Stories written before the first pass stay in stories_unranged, now bounded below the ranges by a
    validated CHECK; ranges cover two widths above the next id, stories_ahead the rest; a second pass with
    nothing new adds nothing."""
    client_id, _ = await ops_seed.client(conn, "early")
    (old,) = await _seed(conn, [ops_seed.completed(client_id, 60)])
    kept = await _keep(pool)
    cur = await conn.execute("SELECT pg_get_constraintdef(oid), convalidated FROM pg_constraint "
                             "WHERE conrelid = 'stories_unranged'::regclass AND contype = 'c'")
    ((check, validated),) = await cur.fetchall()
    bound = old.id + 1 + partitions.MIN_WIDTH
    assert check == f"CHECK ((job_id < {bound}))" and validated
    assert await _ranges(conn) == [(f"stories_from_{bound}", bound, bound + partitions.MIN_WIDTH),
                                   ("stories_ahead", bound + partitions.MIN_WIDTH, None)]
    assert kept == partitions.StoryPartitionsKept(added=1, dropped=0, behind=False)
    assert await _partition_of(conn, old.id) == "stories_unranged"
    assert await _keep(pool) == partitions.StoryPartitionsKept(added=0, dropped=0, behind=False)


async def test_a_story_written_by_a_worker_lands_in_its_range_and_is_served_from_it(
    client: httpx.AsyncClient, conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
) -> None:
    """Once the ids reach the first range, the worker's settle writes the story there, and both the poll and
    GET /stories/{story_id} find it; the ranges move ahead with the ids."""
    from worker.offline import OfflineWriter

    await _keep(pool)
    ((_, lo, _), _) = await _ranges(conn)
    await _next_id_at(conn, lo)
    async with running_worker(worker_settings(), pool, OfflineWriter(0), listen_url=database_url):
        answer = await client.post("/stories/generate", json={"prompt": "a lantern fish"},
                                   headers={"Idempotency-Key": str(uuid.uuid4())})
        job_id = answer.json()["job_id"]

        async def completed() -> bool:
            return bool((await client.get(f"/stories/jobs/{job_id}")).json()["status"] == "completed")

        await wait_until(completed, what="the job to complete")
    body = (await client.get(f"/stories/jobs/{job_id}")).json()
    assert await _partition_of(conn, lo) == f"stories_from_{lo}"
    story = (await client.get(body["story_url"])).json()
    assert story["text"] == body["story"]["text"] and "a lantern fish" in story["text"]
    kept = await _keep(pool)
    assert kept.added >= 1 and (await _ranges(conn))[-1][1] >= lo + 1 + partitions.AHEAD * partitions.MIN_WIDTH


async def test_a_range_is_dropped_once_its_every_job_is_pruned_and_not_before(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    """A range whose jobs are all past retention and pruned goes whole, with its stories; while one of its
    jobs is kept (a webhook delivery still pending, on the range's first id) it stays, and the prune leaves
    its stories to the drop. Jobs outside it (one kept below the ranges, one on the next range's first id)
    do not hold it."""
    client_id, key = await ops_seed.client(conn, "history")
    (early,) = await _seed(conn, [ops_seed.completed(client_id, 41 * DAY)])
    await _keep(pool)
    ((first, lo, hi), _) = await _ranges(conn)
    await _next_id_at(conn, lo)
    jobs = await _seed(conn, [ops_seed.completed(client_id, 40 * DAY), ops_seed.completed(client_id, 39 * DAY)])
    assert [job.id for job in jobs] == [lo, lo + 1]
    assert {await _partition_of(conn, job.id) for job in jobs} == {first}
    endpoint = await conn.execute("INSERT INTO webhook_endpoints (client_id, url, events, secret) "
                                  "VALUES (%s, 'https://hooks.example.com/a', '{job.completed}', 'whsec_x') "
                                  "RETURNING id", (client_id,))
    endpoint_id = (await endpoint.fetchall())[0][0]
    for kept in (early, jobs[0]):
        await conn.execute(
            "INSERT INTO webhook_deliveries (endpoint_id, client_id, job_id, job_public_id, job_status, story_id, "
            "occurred_at, state, next_attempt_at) "
            "SELECT %s, client_id, id, public_id, status, story_id, completed_at, 'pending', now() "
            "FROM story_jobs WHERE id = %s", (endpoint_id, kept.id))
    # the ids move on past the range, as a month of jobs would take them
    await _next_id_at(conn, hi)
    (above,) = await _seed(conn, [ops_seed.completed(client_id, 3600)])
    assert above.id == hi
    store = PgSweeperStore(pool)
    pruned = await store.prune_finished(retention_s=RETENTION_S, batch_size=100)
    assert [job.id for job in pruned] == [jobs[1].id]
    # the prune leaves a ranged story to its partition's drop, and it is no longer served
    assert await count(conn, "SELECT count(*) FROM stories WHERE job_id = %s", jobs[1].id) == 1
    assert await _served(conn, key, jobs[1]) is None
    assert (await _served(conn, key, jobs[0]) or {}).get("job_id") == str(jobs[0].public_id)
    assert (await _keep(pool)).dropped == 0
    assert first in [name for name, _, _ in await _ranges(conn)]
    await conn.execute("UPDATE webhook_deliveries SET state = 'delivered', delivered_at = now() WHERE job_id = %s",
                       (jobs[0].id,))
    assert [job.id for job in await store.prune_finished(retention_s=RETENTION_S, batch_size=100)] == [jobs[0].id]
    with capture_logs() as logs:
        assert (await _keep(pool)).dropped == 1
    assert first not in [name for name, _, _ in await _ranges(conn)]
    assert await count(conn, "SELECT count(*) FROM stories WHERE job_id >= %s AND job_id < %s", lo, hi) == 0
    assert await count(conn, "SELECT count(*) FROM stories WHERE job_id IN (%s, %s)", early.id, above.id) == 2
    assert [entry["partition"] for entry in logs if entry["event"] == "sweeper.story_partition_dropped"] == [first]


async def test_an_empty_range_is_kept_while_an_admission_could_still_take_an_id_there(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    """No job in the range, and the only job above it was admitted under 5 minutes ago: an admission still
    open could hold an id of the range and then bring its story, so the range stays. Once a job above it
    is older, it goes."""
    await _keep(pool)
    ((first, _, hi), _) = await _ranges(conn)
    await _next_id_at(conn, hi + 5)
    client_id, _ = await ops_seed.client(conn, "now")
    (above,) = await _seed(conn, [ops_seed.completed(client_id, 60)])
    assert (await _keep(pool)).dropped == 0
    assert first in [name for name, _, _ in await _ranges(conn)]
    await conn.execute("UPDATE story_jobs SET created_at = now() - interval '301 seconds' WHERE id = %s",
                       (above.id,))
    assert (await _keep(pool)).dropped == 1


async def test_stories_past_the_ranges_make_stories_ahead_a_range_and_ranges_follow_it(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    """Ids that outran the ranges (a sweeper stopped for days): their stories land in stories_ahead, never
    refused. The next pass makes stories_ahead the range [where it began, a width above the next id), without
    moving a story, and the next adds ranges above it; the stories stay where they are."""
    await _keep(pool)
    (_, (_, ahead_from, _)) = await _ranges(conn)
    late_from = ahead_from + 10 * partitions.MIN_WIDTH
    await _next_id_at(conn, late_from)
    client_id, _ = await ops_seed.client(conn, "late")
    jobs = await _seed(conn, [ops_seed.completed(client_id, 7200), ops_seed.completed(client_id, 3600)])
    assert {await _partition_of(conn, job.id) for job in jobs} == {"stories_ahead"}
    with capture_logs() as logs:
        kept = await _keep(pool)
    # the range the ids jumped over held no job and can get none: it goes
    assert kept == partitions.StoryPartitionsKept(added=1, dropped=1, behind=False)
    assert [entry["event"] for entry in logs if entry["log_level"] == "warning"] == ["sweeper.stories_ahead_closing"]
    closed_to = late_from + 2 + partitions.MIN_WIDTH
    assert (await _ranges(conn))[-2:] == [(f"stories_from_{ahead_from}", ahead_from, closed_to),
                                          ("stories_ahead", closed_to, None)]
    # the ranges follow it at the next pass
    assert (await _keep(pool)).added >= 1
    ranges = await _ranges(conn)
    assert ranges[-1][0] == "stories_ahead" and ranges[-1][1] >= closed_to + partitions.MIN_WIDTH
    assert {await _partition_of(conn, job.id) for job in jobs} == {f"stories_from_{ahead_from}"}
    cur = await conn.execute("SELECT count(*) FROM pg_constraint WHERE conname = 'stories_ahead_below'")
    assert await cur.fetchone() == (0,)
    # the range's unique keys came with it
    with pytest.raises(psycopg.errors.UniqueViolation):
        await conn.execute("INSERT INTO stories (job_id, client_id, title, body, model, prompt_version, "
                           "input_tokens, output_tokens, cost_usd) SELECT job_id, client_id, title, body, model, "
                           "prompt_version, 1, 1, 0 FROM stories WHERE job_id = %s", (jobs[0].id,))


async def test_a_pass_that_stopped_after_bounding_stories_ahead_is_finished_by_the_next(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    """The bound is committed before the validation and the swap: a sweeper that stopped in between leaves
    it NOT VALID, and the next pass validates it and makes the range."""
    await _keep(pool)
    (_, (_, ahead_from, _)) = await _ranges(conn)
    await _next_id_at(conn, ahead_from + 3)
    client_id, _ = await ops_seed.client(conn, "stopped")
    (job,) = await _seed(conn, [ops_seed.completed(client_id, 3600)])
    await conn.execute("SELECT stories_ahead_bound(%s)", (ahead_from + 50,))
    # what the next pass reads: one row, both bounds, only the first validated
    bound = (await _ranges(conn))[0][1]
    assert await fetch_all(conn, partitions.StoryPartitionsState, "story_partitions_state", {}) == [
        partitions.StoryPartitionsState(bound=bound, bound_valid=True, ahead_from_id=ahead_from,
                                        ahead_bound=ahead_from + 50, ahead_bound_valid=False, next_id=job.id + 1)]
    kept = await _keep(pool)
    assert not kept.behind and kept.added >= 1
    assert (f"stories_from_{ahead_from}", ahead_from, ahead_from + 50) in await _ranges(conn)
    assert await _partition_of(conn, job.id) == f"stories_from_{ahead_from}"


@pytest.mark.parametrize("ranges", [False, True], ids=["before-the-first-pass", "after-it"])
async def test_the_prune_deletes_the_old_tables_stories_row_by_row(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, ranges: bool,
) -> None:
    """A story in stories_unranged (written before the first pass) goes with its job's prune, before the
    sweeper's first pass over the partitions and after it; another job's story stays."""
    client_id, _ = await ops_seed.client(conn, "before")
    old, young = await _seed(conn, [ops_seed.completed(client_id, 40 * DAY), ops_seed.completed(client_id, 60)])
    if ranges:
        await _keep(pool)
    await PgSweeperStore(pool).prune_finished(retention_s=RETENTION_S, batch_size=100)
    cur = await conn.execute("SELECT job_id FROM stories")
    assert await cur.fetchall() == [(young.id,)]


async def test_the_prune_leaves_the_stories_in_ranges_and_past_them_for_their_ranges_drop(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    """Two pruned jobs either side of where stories_ahead begins: the story in the last range and the one in
    stories_ahead both wait for a drop, and the next pass makes stories_ahead the range that will take it."""
    await _keep(pool)
    (_, (_, ahead_from, _)) = await _ranges(conn)
    await _next_id_at(conn, ahead_from - 1)
    client_id, _ = await ops_seed.client(conn, "edge")
    in_range, ahead = await _seed(conn, [ops_seed.completed(client_id, 41 * DAY),
                                         ops_seed.completed(client_id, 40 * DAY)])
    assert await _partition_of(conn, ahead.id) == "stories_ahead"
    pruned = await PgSweeperStore(pool).prune_finished(retention_s=RETENTION_S, batch_size=100)
    assert sorted(job.id for job in pruned) == [in_range.id, ahead.id]
    cur = await conn.execute("SELECT job_id FROM stories ORDER BY job_id")
    assert await cur.fetchall() == [(in_range.id,), (ahead.id,)]
    kept = await _keep(pool)
    assert not kept.behind
    assert await _partition_of(conn, ahead.id) == f"stories_from_{ahead_from}"


async def test_a_range_is_as_wide_as_the_ids_the_last_period_took(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    """With a retention of 30 days a period is a day: 1,200 jobs admitted in the last day and 1,500 two days
    ago make the bound and the first range 1,200 ids wide."""
    client_id, _ = await ops_seed.client(conn, "busy")
    await conn.execute(
        "INSERT INTO story_jobs (client_id, idempotency_key, request_fingerprint, request, turn, created_at) "
        "SELECT %s, 'width-' || n, '\\x00', '{\"prompt\": \"a fox\"}'::jsonb, n, "
        "       now() - CASE WHEN n <= 1500 THEN interval '2 days' ELSE interval '1 hour' END "
        "FROM generate_series(1, 2700) AS n ORDER BY n", (client_id,))
    await _keep(pool)
    cur = await conn.execute("SELECT max(id) + 1 FROM story_jobs")
    (next_id,) = await cur.fetchone() or (0,)
    ((_, lo, hi), _) = await _ranges(conn)
    assert (lo, hi) == (next_id + 1200, next_id + 2400)


async def test_a_drop_waits_for_a_reader_at_most_its_lock_timeout_and_tries_again_next_pass(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
) -> None:
    """A reader holding stories in an open transaction: the add gives up after LOCK_TIMEOUT_S (the polls
    behind it wait no longer), changes nothing, and the next pass adds."""
    await _keep(pool)
    (_, (_, ahead_from, _)) = await _ranges(conn)
    await _next_id_at(conn, ahead_from)
    async with await psycopg.AsyncConnection.connect(database_url) as reader:
        await reader.execute("SELECT count(*) FROM stories")
        with capture_logs() as logs:
            kept = await asyncio.wait_for(_keep(pool), timeout=10)
        await reader.rollback()
    assert kept.added == 0 and not kept.behind
    assert [(entry["event"], entry["statement"]) for entry in logs if entry["log_level"] == "warning"] == [
        ("sweeper.story_partitions_lock_waited", "story_partition_add")]
    assert (await _keep(pool)).added >= 1
    assert (await _ranges(conn))[-1][1] > ahead_from


async def test_two_passes_at_once_leave_one_bound_and_one_set_of_ranges(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
) -> None:
    """The sweeper's pass and `storyjobs migrate`'s at the same moment: each change locks stories and looks
    again, so the second finds the work done; neither fails, and the ranges are those of one pass."""
    client_id, _ = await ops_seed.client(conn, "twice")
    await _seed(conn, [ops_seed.completed(client_id, 60)])

    async def one_pass() -> partitions.StoryPartitionsKept:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as own:
            return await partitions.keep(own, retention_s=RETENTION_S)

    first_round = await asyncio.gather(one_pass(), one_pass())
    # one range made, counted once
    assert (sum(k.added for k in first_round), sum(k.dropped for k in first_round)) == (1, 0)
    for _ in range(2):
        kept = await asyncio.gather(one_pass(), one_pass())
        assert not any(k.behind for k in kept + first_round)
    ranges = await _ranges(conn)
    assert [name for name, _, _ in ranges].count("stories_ahead") == 1
    assert all(hi == following for (_, _, hi), (_, following, _) in zip(ranges, ranges[1:], strict=False))
    cur = await conn.execute("SELECT count(*) FROM pg_constraint WHERE conname = 'stories_unranged_below' "
                             "AND convalidated")
    assert await cur.fetchone() == (1,)


async def test_an_add_from_ranges_read_before_another_callers_add_changes_nothing(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    """story_partition_add with the top a caller read before another caller moved it: it answers NULL under
    the lock and leaves the ranges as they are (the caller's next pass reads them again)."""
    await _keep(pool)
    before = await _ranges(conn)
    ((_, first_lo, first_hi), _) = before
    cur = await conn.execute("SELECT story_partition_add(%s, %s)", (first_lo, first_hi))
    assert await cur.fetchone() == (None,)
    assert await _ranges(conn) == before
