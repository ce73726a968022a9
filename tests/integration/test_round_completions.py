"""The round's settle of its written stories: each written story reaches its own job,
whatever order the worker lists them in and whatever they hold."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import psycopg

from shared.status import ErrorCode, LlmOutcome
from tests.support import worker_statements
from tests.support.database import client_id_of, enqueue, story_written
from worker.rows import Completion, Failure

# a title and a text with what a JSON or an array literal would have to escape
_ODD = 'quote " backslash \\ brace { comma , newline \n tab \t emoji \N{OWL} accent é'


async def test_each_completion_of_a_round_is_stored_with_its_own_job(conn: psycopg.AsyncConnection[Any]) -> None:
    """Five completions in one round, listed in descending job id order (the statement sorts them): each
    job gets its own title, text, figures and request id, and points at its own story."""
    client = await client_id_of(conn)
    for n in range(5):
        await enqueue(conn, client, f"story {n}")
    claimed = (await worker_statements.job_claim(conn, worker_id="w1", claim_limit=5,
                                                       provider="offline", model="offline-writer")).claimed
    written = [Completion(job_id=job.id, client_id=client, attempt=1, title=f"Title {job.id} {_ODD}",
                          body=f"Text of job {job.id}. {_ODD} " * (job.id % 3 + 1), model="m", prompt_version="v",
                          input_tokens=10 + job.id, output_tokens=20 + job.id,
                          cost_usd=Decimal(job.id) / 1000, request_id=f"req_{job.id}")
               for job in sorted(claimed, key=lambda job: job.id, reverse=True)]
    settled = await worker_statements.job_settle(conn, worker_id="w1", completions=written)
    assert sorted(settled.completed_ids) == sorted(job.id for job in claimed)
    cur = await conn.execute(
        "SELECT j.id, s.job_id, s.title, s.body, s.input_tokens, s.output_tokens, s.cost_usd, j.charged_usd, "
        "       c.request_id "
        "FROM story_jobs j JOIN stories s ON s.id = j.story_id JOIN llm_calls c ON c.job_id = j.id "
        "ORDER BY j.id")
    stored = await cur.fetchall()
    expected = [(c.job_id, c.job_id, c.title, c.body, c.input_tokens, c.output_tokens, c.cost_usd, c.cost_usd,
                 c.request_id) for c in sorted(written, key=lambda c: c.job_id)]
    assert stored == expected


async def test_an_end_sent_by_a_worker_that_does_not_hold_the_job_changes_nothing(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """The end's holder guard (jobs_end's by_worker): a story or a failure written for a running job by a worker
    that did not claim it (a mistaken id, a worker that lost track) ends nothing; the job stays with its worker,
    uncharged."""
    client = await client_id_of(conn)
    await enqueue(conn, client, "a fox")
    (job,) = (await worker_statements.job_claim(conn, worker_id="w1", claim_limit=1,
                                           provider="offline", model="offline-writer")).claimed
    failed = await worker_statements.job_fail_running(conn, worker_id="w2", failures=[Failure(
        job_id=job.id, attempt=1, error_code=ErrorCode.LLM_ERROR, error_text="x",
        call_outcome=LlmOutcome.FAILED, billed=False)])
    settled = await worker_statements.job_settle(conn, worker_id="w2", completions=[story_written(job.id)])
    assert list(failed) == [] and settled.completed_ids == []
    cur = await conn.execute("SELECT status::text, worker_id, charged_usd FROM story_jobs WHERE id = %s", (job.id,))
    assert await cur.fetchone() == ("running", "w1", None)
