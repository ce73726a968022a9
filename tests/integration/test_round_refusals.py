"""A claim the database refuses: the worker's stories, which were paid for
and are settled first in the round's one transaction, are never failed
for it (they are sent again alone); and stories the database refuses take
the claim sent with them back too."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from shared.ratelimit import NO_LIMITS, RateLimits
from tests.support.database import client_id_of, count, enqueue, job_rows, story_written
from tests.support.settings import worker_settings
from tests.support.waiting import wait_until
from worker.coordinator import Coordinator
from worker.offline import OfflineWriter
from worker.pg_store import PgWorkerStore
from worker.store import ClaimAsk

# a claim is refused for good (not a transient error) by a trigger on its
# UPDATE: as a broken row, a CHECK or a bug in the claim's half would refuse it
_REFUSE_CLAIMS = """
CREATE FUNCTION refuse_claims() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.status = 'pending' AND NEW.status = 'running' THEN
        RAISE EXCEPTION 'claims are refused' USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_claims BEFORE UPDATE ON story_jobs FOR EACH ROW EXECUTE FUNCTION refuse_claims();
"""


@pytest.mark.parametrize("limited", [False, True], ids=["unlimited", "rate-limited"])
async def test_a_claim_the_database_refuses_never_fails_a_story_that_was_paid_for(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool, limited: bool,
) -> None:
    """A round whose claim is refused while it carries a written story stores the story and completes its
    job (the round rolled back, the story then settled alone), never fails it as unstorable; claims resume once they are
    taken."""
    client = await client_id_of(conn)
    await enqueue(conn, client, "the story that was paid for")
    settings = worker_settings(llm_requests_per_minute=600) if limited else worker_settings()
    writer = OfflineWriter(0)
    store = PgWorkerStore(pool, worker_id="w-refused", provider=writer.provider, model=writer.model,
                          default_max_tokens=settings.llm_max_tokens)
    await store.ensure_rate_bucket(RateLimits.from_settings(settings) if limited else NO_LIMITS)
    worker = Coordinator(settings, store, writer, listen=False)
    assert (await worker.round_once()).claimed == 1
    await wait_until(lambda: all(not h.running for h in worker.held), what="the story to be written")
    await conn.execute(_REFUSE_CLAIMS)
    await enqueue(conn, client, "a story whose claim is refused")
    worker.notified()
    with capture_logs() as logs:
        refused = await worker.round_once()
    assert refused.database_error is not None and "23514" in refused.database_error
    assert (refused.completed, refused.unstorable, refused.failed, refused.claimed) == (1, 0, 0, 0)
    assert "job.completion_unstorable" not in [e["event"] for e in logs]
    first, second = sorted(await job_rows(conn), key=lambda row: row.id)
    assert (first.status, first.error_code, second.status) == ("completed", None, "pending")
    assert await count(conn, "SELECT count(*) FROM stories WHERE job_id = %s", first.id) == 1
    await conn.execute("DROP TRIGGER refuse_claims ON story_jobs")
    assert (await worker.round_once()).claimed == 1


_REFUSE_STORIES = """
CREATE FUNCTION refuse_stories() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'stories are refused' USING ERRCODE = 'check_violation';
END $$;
CREATE TRIGGER refuse_stories BEFORE INSERT ON stories FOR EACH ROW EXECUTE FUNCTION refuse_stories();
"""


async def test_stories_the_database_refuses_take_the_claim_sent_with_them_back(
    conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool,
) -> None:
    """The round's stories and its claim are one transaction: when the stories are refused, nothing of it
    commits: the job stays running, the claim sent with them claimed nothing (its job pending, no ledger
    row), and the error raised is the stories'."""
    client = await client_id_of(conn)
    await enqueue(conn, client, "a story whose settle is refused")
    await enqueue(conn, client, "a story claimed in the same round")
    store = PgWorkerStore(pool, worker_id="w-refused", provider="offline", model="m", default_max_tokens=4000)
    first = (await store.settle_and_claim([], ClaimAsk(1), NO_LIMITS)).claimed
    assert first is not None
    (job,) = first.claimed
    await conn.execute(_REFUSE_STORIES)
    with pytest.raises(psycopg.errors.CheckViolation, match="stories are refused"):
        await store.settle_and_claim([story_written(job.id)], ClaimAsk(1), NO_LIMITS)
    running, waiting = sorted(await job_rows(conn), key=lambda row: row.id)
    assert (running.status, waiting.status) == ("running", "pending")
    assert await count(conn, "SELECT count(*) FROM llm_calls") == 1
    await conn.execute("DROP TRIGGER refuse_stories ON stories")
    written = await store.settle_and_claim([story_written(job.id)], ClaimAsk(1), NO_LIMITS)
    assert written.settled is not None and written.settled.completed_ids == [job.id]
    assert written.claimed is not None and [j.id for j in written.claimed.claimed] == [waiting.id]
