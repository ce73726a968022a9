"""Drafts on a real Postgres: the text streamed so far, appended by the worker
while its job runs, guarded on the job's row, and deleted by the job's end
whatever ends it. Orderings are forced with row and table locks, never with
sleeps."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg
import psycopg_pool
import pytest
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from api.store import ApiStore
from shared.status import ErrorCode, LlmOutcome
from sweeper.store import PgSweeperStore
from sweeper.sweep import Sweeper
from tests.fakes.anthropic_server import FakeAnthropic, FakeAnthropicServer, Plan
from tests.support import worker_statements
from tests.support.database import (
    client_id_of,
    count,
    enqueue,
    job_rows,
    story_written,
    waiting_on_a_lock,
)
from tests.support.settings import sweeper_settings, worker_settings
from tests.support.waiting import wait_until
from tests.support.workers import running_worker
from worker.anthropic_writer import AnthropicWriter
from worker.coordinator import Coordinator
from worker.rows import DraftPiece, Failure

STORY = ("Title: The Owl Who Counted Stars\nOnce upon a time, in a quiet wood, a small owl sat on a branch "
         "and counted the stars, one by one, until her eyes closed all by themselves. The end.")


async def _draft(conn: psycopg.AsyncConnection[Any], job_id: int | None = None) -> str:
    cur = await conn.execute("SELECT coalesce(string_agg(text, '' ORDER BY job_id, from_char), '') "
                             "FROM story_draft_chunks WHERE %(job_id)s::bigint IS NULL OR job_id = %(job_id)s",
                             {"job_id": job_id})
    row = await cur.fetchone()
    assert row is not None
    return str(row[0])


async def _chunks(conn: psycopg.AsyncConnection[Any]) -> int:
    return await count(conn, "SELECT count(*) FROM story_draft_chunks")


async def _claim(conn: psycopg.AsyncConnection[Any], worker_id: str = "w1") -> int:
    result = await worker_statements.job_claim(conn, worker_id=worker_id, claim_limit=1, provider="anthropic", model="m")
    (job,) = result.claimed
    return job.id


async def _append(conn: psycopg.AsyncConnection[Any], job_id: int, from_char: int, text: str,
                  worker_id: str = "w1") -> dict[int, int]:
    return await worker_statements.draft_append(conn, worker_id=worker_id,
                                           pieces=[DraftPiece(job_id, from_char, text)])


async def test_a_draft_is_appended_only_where_it_ends_and_only_by_the_jobs_worker(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """Pieces are appended in order and counted in code points; a piece sent again (its answer lost), one that
    does not start where the draft ends, and another worker's piece change nothing, and each answer says how
    long the draft is."""
    await enqueue(conn, await client_id_of(conn), "an owl")
    job = await _claim(conn)
    assert await _append(conn, job, 0, "Once upon ") == {job: 10}
    assert await _append(conn, job, 10, "a tim\u00e9 \U0001f319") == {job: 18}
    assert await _append(conn, job, 10, "a tim\u00e9 \U0001f319") == {job: 18}
    assert await _append(conn, job, 3, "hole") == {job: 18}
    assert await _append(conn, job, 18, "!", worker_id="w2") == {}
    assert await _draft(conn, job) == "Once upon a tim\u00e9 \U0001f319"
    assert await count(conn, "SELECT sum(chars) FROM story_draft_chunks") == 18


async def test_a_draft_emptied_by_a_crash_is_not_continued_with_a_hole(conn: psycopg.AsyncConnection[Any]) -> None:
    """After the unlogged table is emptied (what a crash of Postgres does to it), a piece that starts past 0 is
    refused and the answer says 0, so the worker sends the whole text again."""
    await enqueue(conn, await client_id_of(conn), "an owl")
    job = await _claim(conn)
    await _append(conn, job, 0, "Once ")
    await conn.execute("TRUNCATE story_draft_chunks")
    assert await _append(conn, job, 5, "upon") == {job: 0}
    assert await _append(conn, job, 0, "Once upon") == {job: 9}
    assert await _draft(conn, job) == "Once upon"


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("end", ["cancel", "sweep", "complete", "fail"])
async def test_the_end_of_a_job_deletes_its_draft(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, end: str,
) -> None:
    """A cancel, a sweep, and the worker's own completion and failure each delete the job's draft in the
    statement that ends it; nothing is written to it afterwards."""
    client = await client_id_of(conn)
    public_id = await enqueue(conn, client, "an owl")
    job = await _claim(conn)
    await _append(conn, job, 0, "Once upon a time")
    if end == "cancel":
        result = await ApiStore(conn).job_cancel(client_id=client, job_id=public_id)
        assert result is not None and result.cancelled
    elif end == "complete":
        settled = await worker_statements.job_settle(conn, worker_id="w1", completions=[story_written(job)])
        assert settled.completed_ids == [job]
    elif end == "fail":
        assert await worker_statements.job_fail_running(conn, worker_id="w1", failures=[Failure(
            job_id=job, attempt=1, error_code=ErrorCode.LLM_ERROR, error_text="x",
            call_outcome=LlmOutcome.FAILED, billed=False)]) == [job]
    else:
        await conn.execute("UPDATE story_jobs SET heartbeat_at = now() - interval '1 hour'")
        clock = _Clock()
        sweeper = Sweeper(sweeper_settings(heartbeat_timeout_s=60), PgSweeperStore(pool), clock=clock)
        await sweeper.probe()
        clock.now += 61
        assert (await sweeper.sweep_once()).interrupted == 1
    assert [r.status for r in await job_rows(conn)] == ["completed" if end == "complete" else "failed"]
    assert await _chunks(conn) == 0
    assert await _append(conn, job, 16, ", an owl") == {}
    assert await _chunks(conn) == 0


async def test_an_end_that_waits_for_a_draft_write_deletes_what_it_wrote(
    conn: psycopg.AsyncConnection[Any], database_url: str,
) -> None:
    """A draft write holds its job's row until it commits: a cancel meanwhile waits for it, then deletes the
    draft it wrote. No draft outlives its job."""
    client = await client_id_of(conn)
    public_id = await enqueue(conn, client, "an owl")
    job = await _claim(conn)
    async with await psycopg.AsyncConnection.connect(database_url) as writer, \
            await psycopg.AsyncConnection.connect(database_url, autocommit=True) as canceller:
        assert await _append(writer, job, 0, "Once upon a time") == {job: 16}  # open transaction
        cancel = asyncio.create_task(ApiStore(canceller).job_cancel(client_id=client, job_id=public_id))
        await wait_until(lambda: waiting_on_a_lock(conn), timeout=5, what="the cancel to wait for the draft")
        assert not cancel.done()
        await writer.commit()
        result = await cancel
    assert result is not None and result.cancelled
    assert await _chunks(conn) == 0


async def test_a_draft_write_that_waits_for_an_end_writes_nothing(
    conn: psycopg.AsyncConnection[Any], database_url: str,
) -> None:
    """A draft write that meets an end not yet committed waits for it, then finds the job ended and writes
    nothing."""
    client = await client_id_of(conn)
    public_id = await enqueue(conn, client, "an owl")
    job = await _claim(conn)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as canceller, \
            await psycopg.AsyncConnection.connect(database_url, autocommit=True) as writer:
        async with canceller.transaction():
            result = await ApiStore(canceller).job_cancel(client_id=client, job_id=public_id)
            assert result is not None and result.cancelled
            append = asyncio.create_task(_append(writer, job, 0, "Once upon a time"))
            await wait_until(lambda: waiting_on_a_lock(conn), timeout=5, what="the draft write to wait for the end")
        assert await append == {}
    assert await _chunks(conn) == 0


async def _ledger_closed(conn: psycopg.AsyncConnection[Any]) -> bool:
    return await count(conn, "SELECT count(*) FROM llm_calls WHERE finished_at IS NULL") == 0


async def test_a_running_workers_draft_follows_the_stream_and_ends_with_the_story(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
) -> None:
    """While the stream runs, the draft is the text streamed so far; the completion stores the story and
    deletes the draft in its statement."""
    streamed = threading.Event()
    fake = FakeAnthropic(default=Plan(chunks=6, duration_s=0.3, text=STORY, hold=streamed))
    with FakeAnthropicServer(fake) as provider:
        settings = worker_settings(anthropic_api_key="test", anthropic_base_url=provider.base_url,
                                   draft_interval_s=0.05)
        writer = AnthropicWriter(settings)
        try:
            async with running_worker(settings, pool, writer, listen_url=database_url, drafts_pool=pool):
                await enqueue(conn, await client_id_of(conn), "an owl")

                async def whole_text_drafted() -> bool:
                    return await _draft(conn) == STORY

                await wait_until(whole_text_drafted, timeout=10, what="the whole streamed text in the draft")
                assert await _chunks(conn) > 1  # appended as it came, not written once
                streamed.set()
                await wait_until(lambda: _finished(conn), timeout=10, what="the job to complete")
        finally:
            await writer.aclose()
    (job,) = await job_rows(conn)
    assert job.status == "completed"
    assert await _chunks(conn) == 0
    cur = await conn.execute("SELECT title, body FROM stories")
    assert await cur.fetchall() == [("The Owl Who Counted Stars", STORY.partition("\n")[2])]


async def _finished(conn: psycopg.AsyncConnection[Any]) -> bool:
    return all(row.status in ("completed", "failed") for row in await job_rows(conn))


async def test_a_cancel_stops_the_draft_at_once(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
) -> None:
    """A cancel deletes the draft in its own statement, and the worker, whose stream goes on until its next
    heartbeat, writes none of what it streams after it."""
    fake = FakeAnthropic(default=Plan(chunks=10, duration_s=2.0, text=STORY))
    with FakeAnthropicServer(fake) as provider:
        # heartbeats far apart: the call streams on after the cancel, and only the draft's guard stops it
        # (draft writes driven by the test: the interval's own come later than the test ends)
        settings = worker_settings(anthropic_api_key="test", anthropic_base_url=provider.base_url,
                                   draft_interval_s=60, heartbeat_interval_s=10, heartbeat_timeout_s=60)
        writer = AnthropicWriter(settings)
        try:
            async with running_worker(settings, pool, writer, listen_url=database_url, drafts_pool=pool) as worker:
                client = await client_id_of(conn)
                public_id = await enqueue(conn, client, "an owl")
                await wait_until(lambda: _streamed_more(worker, 0), timeout=10, what="text streamed")
                assert await worker.drafts_once() == 1
                assert await _chunks(conn) > 0
                result = await ApiStore(conn).job_cancel(client_id=client, job_id=public_id)
                assert result is not None and result.cancelled
                assert await _chunks(conn) == 0
                (held,) = list(worker.held)
                at_cancel = held.call.text.chars
                await wait_until(lambda: _streamed_more(worker, at_cancel), timeout=10,
                                 what="more text streamed after the cancel")
                # its new text is sent (the job is still held), and refused by the guard
                assert await worker.drafts_once() == 1
                assert await _chunks(conn) == 0
        finally:
            await writer.aclose()
    assert await _chunks(conn) == 0


async def test_a_worker_sends_the_whole_text_again_after_its_draft_was_emptied(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
) -> None:
    """After a crash of Postgres empties the unlogged drafts (forced with TRUNCATE), the worker's next write is
    told the draft is empty and the one after sends the whole text streamed so far: the draft has no hole."""
    hold = threading.Event()
    fake = FakeAnthropic(default=Plan(chunks=6, duration_s=0.6, text=STORY, hold=hold))
    with FakeAnthropicServer(fake) as provider:
        settings = worker_settings(anthropic_api_key="test", anthropic_base_url=provider.base_url,
                                   draft_interval_s=60)
        writer = AnthropicWriter(settings)
        try:
            async with running_worker(settings, pool, writer, listen_url=database_url, drafts_pool=pool) as worker:
                await enqueue(conn, await client_id_of(conn), "an owl")
                await wait_until(lambda: _streamed_more(worker, 20), timeout=10, what="text streamed")
                assert await worker.drafts_once() == 1
                await conn.execute("TRUNCATE story_draft_chunks")
                (held,) = list(worker.held)
                written = held.call.text.chars
                await wait_until(lambda: _streamed_more(worker, written), timeout=10, what="more text streamed")
                await worker.drafts_once()  # refused: the draft is not where the worker left it
                assert await _draft(conn) == ""
                await wait_until(lambda: _all_streamed(worker), timeout=10, what="the whole text streamed")
                assert await worker.drafts_once() == 1
                assert await _draft(conn) == STORY
                hold.set()
                await wait_until(lambda: _finished(conn), timeout=10, what="the job to complete")
        finally:
            await writer.aclose()
    assert await _chunks(conn) == 0


async def _all_streamed(worker: Coordinator) -> bool:
    return any(held.call.text.chars == len(STORY) for held in worker.held)


async def _streamed_more(worker: Coordinator, than: int) -> bool:
    return any(held.call.text.chars > than for held in worker.held)


async def test_a_database_error_while_writing_drafts_never_fails_or_stops_the_job(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, database_url: str,
) -> None:
    """With every draft write refused by the database (its connection is read-only, as a replica's or a
    failing-over primary's is), the error is logged once for the whole run, with the jobs it was for, and
    the job completes with its whole story as if drafts were off."""
    read_only = psycopg_pool.AsyncConnectionPool(
        database_url, kwargs={"autocommit": True, "options": "-c default_transaction_read_only=on"},
        min_size=1, max_size=1, timeout=2, open=False)
    await read_only.open(wait=True)
    fake = FakeAnthropic(default=Plan(chunks=6, duration_s=0.6, text=STORY))
    try:
        with FakeAnthropicServer(fake) as provider, capture_logs() as logs:
            settings = worker_settings(anthropic_api_key="test", anthropic_base_url=provider.base_url,
                                       draft_interval_s=0.05)
            writer = AnthropicWriter(settings)
            try:
                async with running_worker(settings, pool, writer, listen_url=database_url, drafts_pool=read_only):
                    await enqueue(conn, await client_id_of(conn), "an owl")
                    await wait_until(lambda: _finished(conn), timeout=10, what="the job to complete")
            finally:
                await writer.aclose()
    finally:
        await read_only.close()
    (job,) = await job_rows(conn)
    assert job.status == "completed"
    cur = await conn.execute("SELECT body FROM stories")
    assert await cur.fetchall() == [(STORY.partition("\n")[2],)]
    errors = [e for e in logs if e["event"] == "worker.database_error" and e.get("task") == "drafts"]
    assert len(errors) == 1, errors
    assert errors[0]["job_ids"] == [job.id] and errors[0]["sqlstate"] == "25006"
    assert await _chunks(conn) == 0
