"""The batch lane on Postgres against the fake provider's batch endpoints,
one tick at a time: a batch submitted, collected and ingested; each fault
the provider can throw at it (a create whose answer is lost, with or
without the batch made, a results stream cut halfway or leaving a request
out, errored, expired and canceled requests, a refused request); cancels;
two would-be submitters. The fake's record of what it billed is how each
test proves "billed once"."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from api.store import ApiStore
from tests.fakes.anthropic_batches import BatchPlan, FakeBatches, Fault, ItemPlan
from tests.support.database import (
    cancel_pending_in_bulk,
    client_id_of,
    count,
    enqueue,
    enqueue_batch,
)
from tests.support.money import money_problems
from tests.support.settings import worker_settings
from worker.batch.anthropic_batches import AnthropicBatches
from worker.batch.lane import BatchLane
from worker.batch.store import BatchStore

Conn = psycopg.AsyncConnection[Any]


def _lane(pool: AsyncConnectionPool, provider: AnthropicBatches, holder: str = "w-1", **settings: Any) -> BatchLane:
    values = {"batch_collect_s": 1.0, "batch_poll_interval_s": 1.0, "batch_reconcile_grace_s": 5.0,
              "anthropic_api_key": "test", **settings}
    lane = BatchLane(worker_settings(**values), BatchStore(pool), provider, holder=holder, clock=_FakeTime())
    return lane


class _FakeTime:
    """The lane's own clock (when a batch was last polled): far apart at each read."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 3600.0
        return self.now


async def _jobs(conn: Conn) -> list[tuple[str, str | None, bool]]:
    cur = await conn.execute("SELECT status::text, error_code, story_id IS NOT NULL FROM story_jobs ORDER BY id")
    return [(row[0], row[1], row[2]) for row in await cur.fetchall()]


async def _ledger(conn: Conn) -> list[tuple[int, int, str, bool]]:
    cur = await conn.execute("SELECT job_id, attempt, outcome, billed FROM llm_calls ORDER BY job_id, attempt")
    return [(row[0], row[1], row[2], row[3]) for row in await cur.fetchall()]


async def test_a_batch_is_submitted_collected_and_its_stories_stored_at_the_batch_price(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """Three waiting jobs go into one batch (running, owned by it); once it ends, each job is completed with
    its story, its ledger row billed at half the price, and the provider billed each request once."""
    client = await client_id_of(conn)
    for n in range(3):
        await enqueue_batch(conn, client, f"a lantern numbered {n}")
    lane = _lane(pool, provider)
    submitted = await lane.tick_once()
    assert submitted.submitted == 3 and submitted.holding
    assert [s for s, _, _ in await _jobs(conn)] == ["running"] * 3
    (batch,) = fake.batches
    fake.end_batch(batch.id)
    collected = await lane.tick_once()
    assert collected.completed == 3
    assert await _jobs(conn) == [("completed", None, True)] * 3
    assert [(a, o, b) for _, a, o, b in await _ledger(conn)] == [(1, "succeeded", True)] * 3
    assert sorted(fake.bills_by_custom_id().values()) == [1, 1, 1]
    cur = await conn.execute("SELECT c.cost_usd, j.charged_usd, s.cost_usd FROM llm_calls c "
                             "JOIN story_jobs j ON j.id = c.job_id JOIN stories s ON s.job_id = j.id")
    for ledger_cost, charged, story_cost in await cur.fetchall():
        assert ledger_cost == charged == story_cost and ledger_cost > 0
    assert await count(conn, "SELECT count(*) FROM message_batches WHERE state = 'ended'") == 1


async def test_a_create_whose_answer_is_lost_is_adopted_by_listing_never_created_again(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """The create's connection closes after the batch was made: the next tick finds it by listing and
    adopts it; no second create is sent, and each request is billed once."""
    client = await client_id_of(conn)
    for n in range(2):
        await enqueue_batch(conn, client, f"a kite numbered {n}")
    fake.queue(BatchPlan(drop_answer=True))
    lane = _lane(pool, provider)
    assert (await lane.tick_once()).submitted == 0
    adopted = await lane.tick_once()
    assert adopted.adopted == 1 and len(fake.creates) == 1
    (batch,) = fake.batches
    fake.end_batch(batch.id)
    assert (await lane.tick_once()).completed == 2
    assert sorted(fake.bills_by_custom_id().values()) == [1, 1]


async def test_a_create_that_made_nothing_and_was_not_answered_fails_its_jobs_as_unknown_after_the_grace(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """A 500 to the create with no batch made: nothing is found by listing; past BATCH_RECONCILE_GRACE_S the
    jobs fail as llm_error, their ledger rows of unknown outcome, each charged its worst case, and no create is
    sent again."""
    client = await client_id_of(conn)
    await enqueue_batch(conn, client, "a boat")
    fake.queue(BatchPlan(status=500))
    lane = _lane(pool, provider, batch_reconcile_grace_s=1.0)
    await lane.tick_once()
    await conn.execute("UPDATE message_batches SET fence_at = fence_at - interval '10 seconds'")
    lost = await lane.tick_once()
    assert lost.lost == 1 and lost.failed == 1
    assert await _jobs(conn) == [("failed", "llm_error", False)]
    ((_, attempt, outcome, billed),) = await _ledger(conn)
    assert (attempt, outcome, billed) == (1, "interrupted", True)
    cur = await conn.execute("SELECT c.worst_case_usd, j.worst_case_usd, j.charged_usd FROM llm_calls c "
                             "JOIN story_jobs j ON j.id = c.job_id")
    ((row_worst, job_worst, charged),) = await cur.fetchall()
    assert row_worst == job_worst == charged and charged > 0
    await lane.tick_once()
    assert len(fake.creates) == 1


async def test_a_results_stream_cut_halfway_and_read_again_changes_nothing(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """Results cut after two of four lines: those two are ingested; the next reading ingests the rest and
    the first two once."""
    client = await client_id_of(conn)
    for n in range(4):
        await enqueue_batch(conn, client, f"a star numbered {n}")
    lane = _lane(pool, provider)
    await lane.tick_once()
    (batch,) = fake.batches
    fake.end_batch(batch.id)
    fake.queue_fault("results", Fault(after_lines=2))
    first = await lane.tick_once()
    second = await lane.tick_once()
    assert (first.completed, second.completed) == (2, 2)
    assert await count(conn, "SELECT count(*) FROM stories") == 4
    assert await count(conn, "SELECT count(*) FROM llm_calls WHERE billed") == 4


async def test_a_request_its_ended_batchs_results_leave_out_fails_charged_its_worst_case(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """An ended batch whose results stream names two of its three requests: those two are completed; the third,
    which may have billed, gets its result all the same, of unknown outcome: its job fails as llm_error, its
    ledger row billed at its worst case, which is the job's charge, and the batch is read."""
    client = await client_id_of(conn)
    for n in range(3):
        await enqueue_batch(conn, client, f"a quiet heron numbered {n}")
    fake.queue_items_for("numbered 1", ItemPlan(line=""))
    lane = _lane(pool, provider)
    await lane.tick_once()
    fake.end_batch(fake.batches[0].id)
    read = await lane.tick_once()
    assert (read.completed, read.failed) == (2, 1)
    assert await _jobs(conn) == [("completed", None, True), ("failed", "llm_error", False), ("completed", None, True)]
    cur = await conn.execute("SELECT c.outcome::text, c.billed, c.worst_case_usd = j.charged_usd FROM llm_calls c "
                             "JOIN story_jobs j ON j.id = c.job_id WHERE j.status = 'failed'")
    assert await cur.fetchall() == [("interrupted", True, True)]
    assert await count(conn, "SELECT count(*) FROM message_batch_items WHERE read_at IS NULL") == 0
    assert await money_problems(conn) == []


async def test_requests_that_billed_nothing_go_into_a_later_batch_until_their_attempts_run_out(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """An expired request and an errored one are sent again in the next batch as attempt 2; a refused one
    (invalid_request) fails at once as llm_rejected; with two attempts allowed, the expired one that
    expires again fails as llm_unavailable. Nothing unbilled is charged."""
    client = await client_id_of(conn)
    for name in ("expires", "errs", "refused"):
        await enqueue_batch(conn, client, f"a story that {name}")
    fake.queue_items_for("that expires", ItemPlan(result="expired"), ItemPlan(result="expired"))
    fake.queue_items_for("that errs", ItemPlan(result="errored", error_type="overloaded_error"))
    fake.queue_items_for("that refused", ItemPlan(result="errored", error_type="invalid_request_error"))
    lane = _lane(pool, provider, batch_max_attempts=2)
    await lane.tick_once()
    fake.end_batch(fake.batches[0].id)
    first = await lane.tick_once()
    assert (first.failed, first.waiting) == (1, 2)
    await conn.execute("UPDATE story_jobs SET batch_ready_at = batch_ready_at - interval '1 hour' "
                       "WHERE batch_ready_at IS NOT NULL")
    resent = await lane.tick_once()
    assert resent.submitted == 2
    fake.end_batch(fake.batches[-1].id)
    await lane.tick_once()
    assert await _jobs(conn) == [("failed", "llm_unavailable", False), ("completed", None, True),
                                 ("failed", "llm_rejected", False)]
    ledger = await _ledger(conn)
    assert [(a, o, b) for _, a, o, b in ledger] == [(1, "expired", False), (2, "expired", False),
                                                    (1, "errored", False), (2, "succeeded", True),
                                                    (1, "rejected", False)]
    cur = await conn.execute("SELECT sum(charged_usd) FILTER (WHERE status = 'failed') FROM story_jobs")
    assert (await cur.fetchone()) == (0,)


async def test_a_job_cancelled_in_flight_reads_cancelled_and_its_billed_story_is_kept_unseen(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """A client cancels a job whose batch is in flight: it reads cancelled at once; its ledger row stays open
    until the result; the result is billed, recorded, its story stored but not shown, the charge its cost."""
    client = await client_id_of(conn)
    job = await enqueue_batch(conn, client, "a cancelled moon")
    await enqueue_batch(conn, client, "a kept moon")
    lane = _lane(pool, provider)
    await lane.tick_once()
    assert await ApiStore(conn).job_cancel(client_id=client, job_id=job) is not None
    assert await count(conn, "SELECT count(*) FROM llm_calls WHERE outcome = 'started'") == 2
    fake.end_batch(fake.batches[0].id)
    await lane.tick_once()
    assert await _jobs(conn) == [("failed", "cancelled", False), ("completed", None, True)]
    assert await count(conn, "SELECT count(*) FROM stories") == 2
    cur = await conn.execute("SELECT c.billed, c.cost_usd = j.charged_usd FROM llm_calls c "
                             "JOIN story_jobs j ON j.id = c.job_id WHERE j.public_id = %s", (job,))
    assert await cur.fetchall() == [(True, True)]


async def test_a_batch_whose_jobs_are_all_cancelled_is_cancelled_at_the_provider(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """Both jobs of a batch in flight cancelled: the next look asks the provider to cancel the batch, and its
    canceled requests bill nothing."""
    client = await client_id_of(conn)
    jobs = [await enqueue_batch(conn, client, f"a cancelled lamp {n}") for n in range(2)]
    lane = _lane(pool, provider)
    await lane.tick_once()
    for job in jobs:
        await ApiStore(conn).job_cancel(client_id=client, job_id=job)
    with capture_logs() as logs:
        await lane.tick_once()
    (batch,) = fake.batches
    assert batch.processing_status in ("canceling", "ended")
    # the log says which: one of ours, every job of it ended, not a stray
    assert [(e["provider_batch_id"], e["stray"]) for e in logs if e["event"] == "batch.cancel_asked"] == [
        (batch.id, False)]
    await lane.tick_once()
    assert fake.bills_by_custom_id() == {}
    assert await count(conn, "SELECT count(*) FROM llm_calls WHERE outcome = 'canceled' AND NOT billed") == 2


async def test_two_would_be_submitters_make_one_batch(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """Two lanes (two workers) tick: one holds the lease and submits; the other does nothing."""
    client = await client_id_of(conn)
    await enqueue_batch(conn, client, "a shared fox")
    first, second = _lane(pool, provider, holder="w-1"), _lane(pool, provider, holder="w-2")
    results = [await first.tick_once(), await second.tick_once(), await first.tick_once()]
    assert [r.holding for r in results] == [True, False, True]
    assert len(fake.creates) == 1


async def test_a_stray_batch_found_after_a_lost_intent_is_cancelled_and_its_results_charged(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """A create answered after the grace (its batch made late, with one request too many to match): the
    intent is lost and its job failed at its worst case; the batch found later is a stray, cancelled, and
    its result brings the job's charge down to what it cost and replaces the request's lost result."""
    client = await client_id_of(conn)
    await enqueue_batch(conn, client, "a late owl")
    fake.queue(BatchPlan(status=500))
    lane = _lane(pool, provider, batch_reconcile_grace_s=1.0)
    await lane.tick_once()
    await conn.execute("UPDATE message_batches SET fence_at = fence_at - interval '10 seconds'")
    assert (await lane.tick_once()).lost == 1
    cur = await conn.execute("SELECT request, model, max_tokens FROM story_jobs")
    row = await cur.fetchone()
    assert row is not None
    (item,) = await (await conn.execute("SELECT custom_id FROM message_batch_items")).fetchall()
    params = {"model": row[1] or "claude-sonnet-5-5", "max_tokens": row[2] or 100,
              "messages": [{"role": "user", "content": "a late owl"}]}
    late = fake.make_batch([{"custom_id": item[0], "params": params}])
    found = await lane.tick_once()
    assert found.strays == 1
    fake.end_batch(late)
    await lane.tick_once()
    cur = await conn.execute("SELECT c.cost_usd, j.charged_usd, c.outcome FROM llm_calls c "
                             "JOIN story_jobs j ON j.id = c.job_id")
    ((cost, charged, outcome),) = await cur.fetchall()
    assert outcome == "succeeded" and cost == charged
    assert await count(conn, "SELECT count(*) FROM message_batches WHERE state = 'ended'") == 1
    # the intent's request, read as lost, now reads as what its stray answered (the console's counts)
    cur = await conn.execute("SELECT result FROM message_batch_items")
    assert await cur.fetchall() == [("succeeded",)]


async def _late_batch_of_the_lost_intent(conn: Conn, fake: FakeBatches, prompt: str) -> str:
    """A batch the provider makes late of the lost intent's one request (``prompt``): its id."""
    cur = await conn.execute("SELECT i.custom_id, j.model, j.max_tokens FROM message_batch_items i "
                             "JOIN message_batches b ON b.id = i.batch_id JOIN story_jobs j ON j.id = i.job_id "
                             "WHERE b.state = 'lost'")
    ((custom_id, model, max_tokens),) = await cur.fetchall()
    return fake.make_batch([{"custom_id": custom_id, "params": {
        "model": model or "claude-sonnet-5-5", "max_tokens": max_tokens or 100,
        "messages": [{"role": "user", "content": prompt}]}}])


async def test_an_intent_lost_days_after_its_fence_still_takes_its_late_batch_for_a_stray(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """An intent whose create went unanswered, reconciled by no holder for two days: it is lost then, and a
    batch of it made after that (a holder paused before its create call, resumed) is watched for a day after
    the loss, not after the fence: recorded as a stray, its success brings the job's charge to its cost
    (found by the lane's model-based test)."""
    client = await client_id_of(conn)
    await enqueue_batch(conn, client, "a sleeping owl")
    fake.queue(BatchPlan(status=500))
    lane = _lane(pool, provider)
    await lane.tick_once()
    await conn.execute("UPDATE message_batches SET fence_at = fence_at - interval '2 days'")
    assert (await lane.tick_once()).lost == 1
    late = await _late_batch_of_the_lost_intent(conn, fake, "a sleeping owl")
    assert (await lane.tick_once()).strays == 1
    fake.end_batch(late)
    await lane.tick_once()
    cur = await conn.execute("SELECT c.cost_usd, j.charged_usd, c.outcome FROM llm_calls c "
                             "JOIN story_jobs j ON j.id = c.job_id")
    ((cost, charged, outcome),) = await cur.fetchall()
    assert outcome == "succeeded" and cost == charged
    assert sum(fake.bills_by_custom_id().values()) == 1


async def test_a_batch_the_provider_no_longer_knows_charges_its_requests_as_of_unknown_outcome(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """A retrieve answered 404 (the batch deleted by someone else): its requests may have been billed, so
    their jobs fail as llm_error, their ledger rows billed at the worst case; nothing is sent again."""
    client = await client_id_of(conn)
    await enqueue_batch(conn, client, "a vanished heron")
    lane = _lane(pool, provider)
    await lane.tick_once()
    fake.queue_fault("retrieve", Fault(status=404))
    await lane.tick_once()
    assert await _jobs(conn) == [("failed", "llm_error", False)]
    ((_, attempt, outcome, billed),) = await _ledger(conn)
    assert (attempt, outcome, billed) == (1, "interrupted", True)
    await lane.tick_once()
    assert len(fake.creates) == 1


async def test_jobs_cancelled_while_waiting_leave_the_line_for_the_jobs_behind_them(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """Two jobs cancelled before any batch took them, older than a third: the next batch holds the third,
    never an intent of ended jobs with nothing to send (found by the lane's model-based test)."""
    client = await client_id_of(conn)
    cancelled = [await enqueue_batch(conn, client, f"a cancelled wren {n}", waited_s=7200.0) for n in range(2)]
    for job in cancelled:
        assert await ApiStore(conn).job_cancel(client_id=client, job_id=job) is not None
    await enqueue_batch(conn, client, "a waiting wren")
    lane = _lane(pool, provider, batch_max_requests=2)
    assert (await lane.tick_once()).submitted == 1
    (batch,) = fake.batches
    assert ["a waiting wren" in item.prompt for item in batch.items] == [True]
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE batch_ready_at IS NOT NULL") == 0


async def test_a_lost_intents_late_batch_is_a_stray_never_the_next_intents_batch_of_another_size(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """A lost intent's batch turns up while the next intent's create is unanswered: a batch of another size
    than the next intent's is not adopted by it; it is recorded as the lost intent's stray."""
    client = await client_id_of(conn)
    await enqueue_batch(conn, client, "a lost lark")
    fake.queue(BatchPlan(status=500))
    lane = _lane(pool, provider)
    await lane.tick_once()
    await conn.execute("UPDATE message_batches SET fence_at = fence_at - interval '1 minute'")
    assert (await lane.tick_once()).lost == 1
    for n in range(2):
        await enqueue_batch(conn, client, f"a later lark {n}")
    fake.queue(BatchPlan(status=500))
    await lane.tick_once()
    await _late_batch_of_the_lost_intent(conn, fake, "a lost lark")
    found = await lane.tick_once()
    assert (found.adopted, found.strays) == (0, 1)
    assert await count(conn, "SELECT count(*) FROM message_batches WHERE state = 'intent'") == 1


async def test_jobs_an_operator_cancels_in_bulk_leave_the_line_and_a_row_left_in_it_is_never_counted(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """The console cancels two waiting batch jobs of a client in bulk, and a third ended job is left in the
    line as the bulk cancel left them before migration 018: the next batch holds only the job still
    waiting, its request count that of its items."""
    client, other = await client_id_of(conn), await client_id_of(conn, "other")
    for n in range(2):
        await enqueue_batch(conn, client, f"a cancelled kite {n}", waited_s=7200.0)
    left = await enqueue_batch(conn, other, "an ended kite", waited_s=7200.0)
    await conn.execute("UPDATE story_jobs SET status = 'failed', error_code = 'cancelled', completed_at = now() "
                       "WHERE public_id = %s", (left,))
    await enqueue_batch(conn, other, "a waiting kite")
    cancelled = await cancel_pending_in_bulk(conn, client)
    assert len(cancelled) == 2
    cur = await conn.execute("SELECT count(*) FROM story_jobs WHERE public_id = ANY (%s) "
                             "AND batch_ready_at IS NOT NULL", (cancelled,))
    assert await cur.fetchone() == (0,)
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE batch_ready_at IS NOT NULL "
                             "AND status = 'pending'") == 1
    assert (await BatchStore(pool).ready_summary(10)).ready == 1
    lane = _lane(pool, provider, batch_max_requests=3)
    assert (await lane.tick_once()).submitted == 1
    (batch,) = fake.batches
    assert ["a waiting kite" in item.prompt for item in batch.items] == [True]
    assert await count(conn, "SELECT request_count FROM message_batches") == 1


async def test_a_job_cancelled_while_waiting_for_a_later_batch_is_charged_nothing(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """A request that expired (billed nothing) puts its job back in the line, running with no call open: a
    client's cancel then charges it nothing, not its worst case, and closes no ledger row."""
    client = await client_id_of(conn)
    job = await enqueue_batch(conn, client, "a twice-tried comet")
    fake.queue_items_for("twice-tried", ItemPlan(result="expired"))
    lane = _lane(pool, provider)
    await lane.tick_once()
    fake.end_batch(fake.batches[0].id)
    assert (await lane.tick_once()).waiting == 1
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE status = 'running' "
                             "AND batch_ready_at IS NOT NULL AND reserved_usd > 0") == 1
    assert await ApiStore(conn).job_cancel(client_id=client, job_id=job) is not None
    cur = await conn.execute("SELECT status::text, error_code, charged_usd, batch_ready_at IS NULL FROM story_jobs")
    assert await cur.fetchall() == [("failed", "cancelled", 0, True)]
    assert await _ledger(conn) == [(await count(conn, "SELECT id FROM story_jobs"), 1, "expired", False)]


async def test_interactive_jobs_never_make_a_batch_due_before_its_window_closes(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """With BATCH_MAX_REQUESTS=2, one batch job inside its collection window and two interactive jobs
    pending, no batch is due: only jobs waiting for a batch count towards a full one."""
    client = await client_id_of(conn)
    await enqueue_batch(conn, client, "a lantern", waited_s=0.0)
    for n in range(2):
        await enqueue(conn, client, f"a kite numbered {n}")
    lane = _lane(pool, provider, batch_collect_s=3600.0, batch_max_requests=2)
    tick = await lane.tick_once()
    assert tick.submitted == 0 and tick.holding
    assert fake.batches == []
