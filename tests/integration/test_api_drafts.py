"""The poll carries the story as it is written: a running job's draft, from
any character on, an ETag over what a client shows with 304 answers on every
state, and the same 404 as for the job when it is another client's."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import psycopg
from psycopg_pool import AsyncConnectionPool

from tests.support import ops_seed as seed
from tests.support import worker_statements
from tests.support.api_client import api_client, assert_problem, completed_job, new_key
from tests.support.database import create_key, job_rows
from worker.rows import DraftPiece


async def _post(client: httpx.AsyncClient, prompt: str) -> str:
    answer = await client.post("/stories/generate", json={"prompt": prompt}, headers=new_key())
    assert answer.status_code == 202, answer.text
    return str(answer.json()["job_id"])


async def _running(conn: psycopg.AsyncConnection[Any], *drafted: str) -> int:
    """Claims the oldest pending job as worker w1, its draft written in these pieces."""
    result = await worker_statements.job_claim(conn, worker_id="w1", claim_limit=1, provider="anthropic", model="m")
    (job,) = result.claimed
    chars = 0
    for piece in drafted:
        written = await worker_statements.draft_append(conn, worker_id="w1", pieces=[DraftPiece(job.id, chars, piece)])
        chars = written[job.id]
    return job.id


async def test_a_running_jobs_draft_is_polled_whole_or_from_a_character(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], api_key: str,
) -> None:
    """The poll of a running job carries its draft (chars in code points, when it last grew); with since=N only
    the text after character N, the whole length still given; past the end, no text."""
    async with api_client(pool, api_key) as client:
        job_id = await _post(client, "a moon")
        await _running(conn, "Title: The Moon\n", "Once upon a tim\u00e9, ", "a moon \U0001f319 rose.")
        whole = "Title: The Moon\nOnce upon a tim\u00e9, a moon \U0001f319 rose."
        answer = await client.get(f"/stories/jobs/{job_id}")
        assert answer.status_code == 200
        draft = answer.json()["draft"]
        assert (draft["text"], draft["chars"]) == (whole, len(whole)) and draft["updated_at"]
        for since in (0, 5, 16, 20, len(whole) - 1, len(whole), len(whole) + 7):
            answer = await client.get(f"/stories/jobs/{job_id}", params={"since": since})
            assert answer.json()["draft"]["text"] == whole[since:], since
            assert answer.json()["draft"]["chars"] == len(whole)
        assert_problem(await client.get(f"/stories/jobs/{job_id}", params={"since": -1}), 400)


async def test_a_running_job_without_text_yet_has_an_empty_draft_and_others_none(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], api_key: str,
) -> None:
    """A running job whose worker wrote nothing yet has an empty draft; a pending job has none."""
    async with api_client(pool, api_key) as client:
        running, pending = await _post(client, "a moon"), await _post(client, "a sun")
        await _running(conn)
        assert (await client.get(f"/stories/jobs/{running}")).json()["draft"] == {
            "text": "", "chars": 0, "updated_at": None}
        assert (await client.get(f"/stories/jobs/{pending}")).json()["draft"] is None


async def _etag_holds(client: httpx.AsyncClient, job_id: str) -> str:
    """The poll's ETag, and that sending it back answers 304 without a body, with the same validators."""
    answer = await client.get(f"/stories/jobs/{job_id}")
    assert answer.status_code == 200 and answer.headers["cache-control"] == "private, no-cache"
    etag = answer.headers["etag"]
    again = await client.get(f"/stories/jobs/{job_id}", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""
    assert again.headers["etag"] == etag and again.headers["cache-control"] == "private, no-cache"
    assert again.headers.get("retry-after") == answer.headers.get("retry-after")
    listed = await client.get(f"/stories/jobs/{job_id}", headers={"If-None-Match": f'"other", {etag}'})
    assert listed.status_code == 304
    return etag


async def test_every_state_answers_304_until_what_a_client_shows_changes(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], api_key: str, database_url: str,
) -> None:
    """Pending, running, completed and failed jobs each answer 304 to their own ETag; a change of queue
    position, draft length, status or story is a new ETag, and the old one gets the whole answer again."""
    async with api_client(pool, api_key) as client:
        first, second = await _post(client, "a moon"), await _post(client, "a sun")
        pending_second = await _etag_holds(client, second)
        job = await _running(conn, "Once ")
        running_first = await _etag_holds(client, first)
        # the job ahead started: the second moved up the queue
        assert pending_second != await _etag_holds(client, second)
        await worker_statements.draft_append(conn, worker_id="w1", pieces=[DraftPiece(job, 5, "upon")])
        grown = await client.get(f"/stories/jobs/{first}", headers={"If-None-Match": running_first})
        assert grown.status_code == 200 and grown.json()["draft"]["chars"] == 9
        assert grown.headers["etag"] != running_first
        cancelled = await client.delete(f"/stories/jobs/{first}")
        assert cancelled.status_code == 200
        failed = await _etag_holds(client, first)
        assert failed not in (running_first, grown.headers["etag"])
        assert (await client.delete(f"/stories/jobs/{second}")).status_code == 200
        done = await completed_job(client, pool, database_url, "a star")
        completed = await _etag_holds(client, str(done["job_id"]))
        assert completed not in (failed, pending_second)


async def test_a_running_jobs_retry_after_is_at_most_two_draft_intervals(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], api_key: str,
) -> None:
    """While drafts are on, a running job is polled again within two draft intervals, so its words flow."""
    for interval, most in ((1.0, 2), (2.5, 5)):
        async with api_client(pool, api_key, draft_interval_s=interval) as client:
            job_id = await _post(client, f"a moon {interval}")
            await _running(conn, "Once ")
            answer = await client.get(f"/stories/jobs/{job_id}")
            assert answer.json()["status"] == "running"
            assert 1 <= int(answer.headers["retry-after"]) <= most


async def test_another_clients_draft_is_the_same_404_as_an_unknown_job(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any],
) -> None:
    """Client B asking for client A's running job, with or without since and If-None-Match, gets exactly the
    answer an unknown id gets, while A reads its draft."""
    alice, bob = await create_key(conn, "alice"), await create_key(conn, "bob")
    async with api_client(pool, alice) as as_alice, api_client(pool, bob) as as_bob:
        job_id = await _post(as_alice, "a secret")
        await _running(conn, "Alice's secret story")
        mine = await as_alice.get(f"/stories/jobs/{job_id}")
        assert mine.json()["draft"]["text"] == "Alice's secret story"
        for params, headers in (({}, {}), ({"since": 3}, {}), ({}, {"If-None-Match": mine.headers["etag"]}),
                                ({}, {"If-None-Match": "*"})):
            theirs = await as_bob.get(f"/stories/jobs/{job_id}", params=params, headers=headers)
            unknown = await as_bob.get(f"/stories/jobs/{uuid.uuid4()}", params=params, headers=headers)
            assert assert_problem(theirs, 404) == assert_problem(unknown, 404)
            assert theirs.headers == unknown.headers
            assert "secret" not in theirs.text
    assert [r.status for r in await job_rows(conn)] == ["running"]


async def test_the_consoles_job_page_shows_a_running_jobs_draft_and_none_once_it_ended(
    pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any], api_key: str,
) -> None:
    """An operator reading a running job sees its draft as its client does; once the job ended, none."""
    operator = await seed.operator_key(conn)
    async with api_client(pool, api_key) as client, api_client(pool, operator) as ops:
        job_id = await _post(client, "a moon")
        await _running(conn, "Title: The Moon\n", "Once upon a time")
        detail = await ops.get(f"/ops/api/jobs/{job_id}")
        assert detail.status_code == 200
        draft = detail.json()["draft"]
        assert (draft["text"], draft["chars"]) == ("Title: The Moon\nOnce upon a time", 32) and draft["updated_at"]
        assert (await client.delete(f"/stories/jobs/{job_id}")).status_code == 200
        assert (await ops.get(f"/ops/api/jobs/{job_id}")).json()["draft"] is None


async def test_the_openapi_document_describes_the_draft_the_validators_and_the_304(pool: AsyncConnectionPool) -> None:
    """The poll's 200 is a JobState with its draft, `since` and If-None-Match are its parameters, and its 304 is
    documented with the validators and pacing of the 200 it stands for."""
    async with api_client(pool) as client:
        document = (await client.get("/schema/openapi.json")).json()
    poll = document["paths"]["/stories/jobs/{job_id}"]["get"]
    assert poll["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/JobState"}
    assert {"since", "If-None-Match"} <= {parameter["name"] for parameter in poll["parameters"]}
    for status in ("200", "304"):
        assert {"ETag", "Cache-Control", "Retry-After"} <= set(poll["responses"][status]["headers"])
    draft = document["components"]["schemas"]["JobState"]["properties"]["draft"]
    assert "#/components/schemas/JobDraft" in str(draft)
    assert set(document["components"]["schemas"]["JobDraft"]["required"]) == {"text", "chars", "updated_at"}
