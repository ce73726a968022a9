"""The batch lane's money on Postgres against the fake provider's batch
endpoints: a job's charge follows what its ledger says, whatever ended it and
whenever its result arrives; a holder paused past its lease changes nothing;
a lost intent holds nothing back; two intents never reuse an attempt; an
intent never waits for a job a cancel is ending.

Each test also checks every charge and budget row against the ledger
(tests/support/money.py), reckoned apart from the database's derivation."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from api.store import ApiStore
from shared.queries import QUERIES as Q
from sweeper.store import PgSweeperStore
from tests.fakes.anthropic_batches import BatchPlan, FakeBatches, ItemPlan
from tests.support.batches import SettableClock
from tests.support.database import client_id_of, count, enqueue_batch, waiting_on_a_lock
from tests.support.money import money_problems
from tests.support.settings import SWEEP, worker_settings
from tests.support.waiting import wait_until
from worker.batch.anthropic_batches import AnthropicBatches
from worker.batch.lane import BatchLane
from worker.batch.rows import Lease
from worker.batch.store import BatchStore

Conn = psycopg.AsyncConnection[Any]


class _FarApart:
    """The lane's own clock (when a batch was last polled): far apart at each read."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 3600.0
        return self.now


class _PausedAfterListing(BatchStore):
    """The real store, which holds its lane once it has read the batches it
    looks after, until the test lets it go on: a holder paused there."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        super().__init__(pool)
        self.paused = asyncio.Event()
        self.resume = asyncio.Event()

    async def live(self) -> Any:
        found = await super().live()
        self.paused.set()
        await self.resume.wait()
        return found


class _PausedAfterKnowing(BatchStore):
    """The real store, which holds its lane once it has asked which of the
    provider's batches it knows, until the test lets it go on: a holder
    paused between what it saw and what it writes of it."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        super().__init__(pool)
        self.paused = asyncio.Event()
        self.resume = asyncio.Event()

    async def known(self, provider_batch_ids: Sequence[str]) -> set[str]:
        found = await super().known(provider_batch_ids)
        self.paused.set()
        await self.resume.wait()
        return found


def _lane(pool: AsyncConnectionPool, provider: AnthropicBatches, holder: str = "w-1", *,
          store: BatchStore | None = None) -> BatchLane:
    settings = worker_settings(batch_collect_s=1.0, batch_poll_interval_s=1.0, batch_reconcile_grace_s=5.0,
                               batch_max_attempts=3, anthropic_api_key="test")
    return BatchLane(settings, store or BatchStore(pool), provider, holder=holder, clock=_FarApart())


async def _charges(conn: Conn) -> list[tuple[str, str | None, Decimal | None]]:
    cur = await conn.execute("SELECT status::text, error_code, charged_usd FROM story_jobs ORDER BY id")
    return await cur.fetchall()


async def _spent(conn: Conn) -> Decimal:
    cur = await conn.execute("SELECT coalesce(sum(spent_usd), 0) FROM budget_days WHERE client_id = 0")
    (spent,) = await cur.fetchone() or (Decimal(0),)
    return Decimal(spent)


async def _lose_an_intent(conn: Conn, lane: BatchLane, fake: FakeBatches, client: int, prompt: str) -> None:
    """A job whose batch's create was answered with a 500, nothing made, and
    no batch of it found within the grace: its intent is lost."""
    await enqueue_batch(conn, client, prompt)
    fake.queue(BatchPlan(status=500))
    await lane.tick_once()
    await conn.execute("UPDATE message_batches SET fence_at = fence_at - interval '10 seconds' "
                       "WHERE state = 'intent'")
    assert (await lane.tick_once()).lost == 1


async def test_a_job_cancelled_while_its_batch_is_in_flight_is_charged_nothing_when_its_result_is_canceled(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """The client cancels a job whose batch is in flight: charged its worst case while its request may still
    bill; the lane cancels the abandoned batch, the request comes back canceled, and the charge and the day's
    spend come down to nothing."""
    client = await client_id_of(conn)
    job = await enqueue_batch(conn, client, "a cancelled moon")
    lane = _lane(pool, provider)
    await lane.tick_once()
    assert await ApiStore(conn).job_cancel(client_id=client, job_id=job) is not None
    ((_, _, charged),) = await _charges(conn)
    assert charged is not None and charged > 0
    await lane.tick_once()
    (batch,) = fake.batches
    assert batch.cancel_initiated_at is not None
    fake.end_batch(batch.id)
    await lane.tick_once()
    assert fake.bills_by_custom_id() == {}
    assert await count(conn, "SELECT count(*) FROM llm_calls WHERE outcome = 'canceled' AND NOT billed") == 1
    assert await _charges(conn) == [("failed", "cancelled", Decimal(0))]
    assert await _spent(conn) == 0
    assert await money_problems(conn) == []


async def test_a_job_swept_while_its_batch_is_in_flight_is_charged_nothing_when_its_result_expired(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """The sweeper fails a batch job an hour after its batch expired (timed_out, charged its worst case);
    the request's result then says it expired, billed nothing: the charge and the spend come down to it."""
    client = await client_id_of(conn)
    await enqueue_batch(conn, client, "a late owl")
    fake.queue_items_for("a late owl", ItemPlan(result="expired"))
    lane = _lane(pool, provider)
    await lane.tick_once()
    await conn.execute("UPDATE message_batches SET expires_at = now() - interval '2 hours'")
    (swept,) = await PgSweeperStore(conn).fail_stale(**SWEEP)
    assert swept.reason == "timed_out"
    ((_, _, charged),) = await _charges(conn)
    assert charged is not None and charged > 0
    fake.end_batch(fake.batches[0].id)
    await lane.tick_once()
    assert await count(conn, "SELECT count(*) FROM llm_calls WHERE outcome = 'expired' AND NOT billed") == 1
    assert await _charges(conn) == [("failed", "timed_out", Decimal(0))]
    assert await _spent(conn) == 0
    assert await money_problems(conn) == []


async def test_a_lost_intents_late_batch_found_and_canceled_charges_nothing(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches, clock: SettableClock,
) -> None:
    """An intent given up as lost charges its job the worst case; its batch turns up late, is taken for a
    stray, cancelled, and answers canceled: the ledger row says unbilled at no cost, and the job's charge and
    the spend come down to nothing."""
    client = await client_id_of(conn)
    lane = _lane(pool, provider)
    await _lose_an_intent(conn, lane, fake, client, "a lost kite")
    ((_, _, charged),) = await _charges(conn)
    assert charged is not None and charged > 0
    cur = await conn.execute("SELECT i.custom_id, j.request->>'prompt' FROM message_batch_items i "
                             "JOIN story_jobs j ON j.id = i.job_id")
    ((custom_id, prompt),) = await cur.fetchall()
    clock.advance(1.0)
    late = fake.make_batch([{"custom_id": custom_id, "params": {
        "model": "claude-test", "max_tokens": 100, "messages": [{"role": "user", "content": prompt}]}}])
    assert (await lane.tick_once()).strays == 1
    await lane.tick_once()
    assert fake.batch(late).cancel_initiated_at is not None
    fake.end_batch(late)
    await lane.tick_once()
    cur = await conn.execute("SELECT outcome::text, billed, cost_usd FROM llm_calls")
    assert await cur.fetchall() == [("canceled", False, Decimal(0))]
    assert await _charges(conn) == [("failed", "llm_error", Decimal(0))]
    assert await _spent(conn) == 0
    assert await money_problems(conn) == []


async def test_a_holder_paused_past_its_lease_never_takes_the_new_holders_batch_for_a_stray(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """A holder reads its batches (an old lost intent among them) and is paused past its lease; the new
    holder creates a batch whose answer is lost; the paused one goes on, lists the provider's batches, and
    finds that batch unknown: it records nothing, so the new holder adopts its batch and its story is
    stored, billed once."""
    client = await client_id_of(conn)
    paused_store = _PausedAfterListing(pool)
    stale = _lane(pool, provider, "w-stale", store=paused_store)
    paused_store.resume.set()
    await _lose_an_intent(conn, stale, fake, client, "an old lost kite")
    await enqueue_batch(conn, client, "a new kite")
    paused_store.paused.clear()
    paused_store.resume.clear()
    tick = asyncio.ensure_future(stale.tick_once())
    await asyncio.wait_for(paused_store.paused.wait(), 10)
    await conn.execute("UPDATE batch_leases SET until = now() - interval '1 second'")
    fresh = _lane(pool, provider, "w-fresh")
    fake.queue(BatchPlan(drop_answer=True))
    assert (await fresh.tick_once()).holding
    assert len(fake.batches) == 1
    paused_store.resume.set()
    assert (await tick).strays == 0
    assert await count(conn, "SELECT count(*) FROM message_batches WHERE state = 'stray'") == 0
    assert (await fresh.tick_once()).adopted == 1
    fake.end_batch(fake.batches[0].id)
    await fresh.tick_once()
    assert [status for status, _, _ in await _charges(conn)] == ["failed", "completed"]
    assert await count(conn, "SELECT count(*) FROM stories") == 1
    assert sorted(fake.bills_by_custom_id().values()) == [1]
    assert await money_problems(conn) == []


async def test_a_holder_paused_past_its_lease_declares_no_intent_lost(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches, clock: SettableClock,
) -> None:
    """A holder lists the provider's batches past an intent's grace, finds none of it, and is paused past its
    lease; meanwhile the intent's batch shows in the list. Gone on, the paused holder declares nothing lost;
    the next holder adopts the batch, and the story is stored, billed once."""
    client = await client_id_of(conn)
    await enqueue_batch(conn, client, "a slow kite")
    fake.queue(BatchPlan(status=500))
    paused_store = _PausedAfterKnowing(pool)
    paused_store.resume.set()
    stale = _lane(pool, provider, "w-stale", store=paused_store)
    await stale.tick_once()
    await conn.execute("UPDATE message_batches SET fence_at = fence_at - interval '10 seconds'")
    paused_store.paused.clear()
    paused_store.resume.clear()
    tick = asyncio.ensure_future(stale.tick_once())
    await asyncio.wait_for(paused_store.paused.wait(), 10)
    cur = await conn.execute("SELECT i.custom_id, j.request->>'prompt' FROM message_batch_items i "
                             "JOIN story_jobs j ON j.id = i.job_id")
    ((custom_id, prompt),) = await cur.fetchall()
    clock.advance(1.0)
    made = fake.make_batch([{"custom_id": custom_id, "params": {
        "model": "claude-test", "max_tokens": 100, "messages": [{"role": "user", "content": prompt}]}}])
    await conn.execute("UPDATE batch_leases SET until = now() - interval '1 second'")
    paused_store.resume.set()
    assert (await tick).lost == 0
    fresh = _lane(pool, provider, "w-fresh")
    assert (await fresh.tick_once()).adopted == 1
    fake.end_batch(made)
    await fresh.tick_once()
    assert [status for status, _, _ in await _charges(conn)] == ["completed"]
    assert sorted(fake.bills_by_custom_id().values()) == [1]
    assert await money_problems(conn) == []


async def test_a_lost_intents_requests_are_read_so_its_jobs_are_pruned_in_their_time(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """An intent declared lost reads its requests as lost: nothing waits for them, and sixty days on the
    prune takes its job like any other."""
    client = await client_id_of(conn)
    await _lose_an_intent(conn, _lane(pool, provider), fake, client, "a lost lamp")
    cur = await conn.execute("SELECT result, read_at IS NOT NULL FROM message_batch_items")
    assert await cur.fetchall() == [("lost", True)]
    pruned = len(await PgSweeperStore(conn).prune_finished(retention_s=30 * 86_400, batch_size=500,
                                                           now=datetime.now(UTC) + timedelta(days=60)))
    assert pruned == 1


async def _intent(conn: Conn, holder: str, token: int) -> tuple[int, list[int]]:
    """A batch's intent, both of its statements, on conn (in the caller's transaction)."""
    cur = await conn.execute(Q["batch_intent_create"], {"holder": holder, "token": token, "lease_s": 60.0,
                                                        "max_requests": 10, "model": "claude-test"})
    row = await cur.fetchone()
    assert row is not None
    batch_id, _, job_ids = row
    await conn.execute(Q["batch_intent_items"], {"holder": holder, "token": token, "batch_id": batch_id,
                                                 "job_ids": job_ids, "model": "claude-test",
                                                 "provider": "anthropic"})
    return batch_id, job_ids


async def _attempts(conn: Conn) -> Sequence[tuple[int, str]]:
    cur = await conn.execute("SELECT attempt, outcome::text FROM llm_calls ORDER BY attempt")
    return await cur.fetchall()


async def test_two_intents_at_once_never_give_a_job_the_same_attempt(
    database_url: str, conn: Conn, pool: AsyncConnectionPool,
) -> None:
    """An intent whose statement began before another intent sent a waiting job (and that attempt billed
    nothing, so the job waits again) takes the job when it gets the lease, and gives it the next attempt,
    not the one its snapshot would have counted."""
    client = await client_id_of(conn)
    await enqueue_batch(conn, client, "a twice-sent fox")
    taken = await BatchStore(pool).lease_take("w-1", 60.0)
    assert taken is not None
    async with await psycopg.AsyncConnection.connect(database_url) as first:
        batch_id, _ = await _intent(first, "w-1", taken.token)
        await first.execute(Q["batch_refused"], {
            "holder": "w-1", "token": taken.token, "batch_id": batch_id, "outcome": "connect_failed",
            "error_code": "llm_unavailable", "error_text": "refused", "max_attempts": 3})
        # the second intent's statement begins now, and waits for the lease's row
        second = asyncio.ensure_future(
            BatchStore(pool).intent_create(Lease("w-1", taken.token), 60.0, max_requests=10,
                                           model="claude-test", provider="anthropic"))
        await wait_until(lambda: waiting_on_a_lock(conn), what="the second intent waits for the lease")
        await first.commit()
    intent = await second
    assert intent is not None and [item.attempt for item in intent.items] == [2]
    assert await _attempts(conn) == [(1, "connect_failed"), (2, "started")]
    assert await money_problems(conn) == []


class _PausedBeforeRefusal(BatchStore):
    """The real store, which holds its lane when its create was refused, just
    before it records the refusal, until the test lets it go on."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        super().__init__(pool)
        self.paused = asyncio.Event()
        self.resume = asyncio.Event()

    async def refused(self, lease: Lease, batch_id: int, **kwargs: Any) -> Any:
        self.paused.set()
        await self.resume.wait()
        return await super().refused(lease, batch_id, **kwargs)


async def test_a_refusal_recorded_while_a_cancel_ends_its_job_leaves_the_job_charged_what_its_ledger_says(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches, database_url: str,
) -> None:
    """A cancel ends the job (its row locked, the charge taken: the request's worst case, its outcome unknown)
    while the lane records that the provider refused the request: the refusal waits for the job's row before it
    closes the ledger row as not billed, so the ledger's trigger sees the job ended and its charge and the day's
    spend come down to nothing."""
    client = await client_id_of(conn)
    job = await enqueue_batch(conn, client, "a refused owl")
    fake.queue(BatchPlan(status=400))
    store = _PausedBeforeRefusal(pool)
    tick = asyncio.create_task(_lane(pool, provider, store=store).tick_once())
    await asyncio.wait_for(store.paused.wait(), timeout=30)
    canceller = await psycopg.AsyncConnection.connect(database_url)
    async with canceller, canceller.transaction():
        assert await ApiStore(canceller).job_cancel(client_id=client, job_id=job) is not None
        store.resume.set()
        await wait_until(lambda: waiting_on_a_lock(conn), timeout=30, what="the refusal to wait for the job")
    await asyncio.wait_for(tick, timeout=30)
    assert await count(conn, "SELECT count(*) FROM llm_calls WHERE NOT billed") == 1
    assert await _charges(conn) == [("failed", "cancelled", Decimal(0))]
    assert await _spent(conn) == 0
    assert await money_problems(conn) == []


async def test_an_intent_takes_the_jobs_behind_one_a_cancel_is_ending_never_waiting_for_it(
    conn: Conn, database_url: str,
) -> None:
    """A cancel is ending the oldest waiting job (its row held until the cancel commits) when the lane makes an
    intent: the intent neither waits for that job nor takes it; it takes the jobs behind it, and the cancel ends
    its job charged nothing."""
    client = await client_id_of(conn)
    held = await enqueue_batch(conn, client, "a held wren", waited_s=7200.0)
    for n in range(2):
        await enqueue_batch(conn, client, f"a free wren {n}")
    # the lane's store on a connection that waits at most a second for any lock
    impatient = AsyncConnectionPool(database_url, kwargs={"autocommit": True, "options": "-c lock_timeout=1000"},
                                    min_size=1, max_size=1, open=False)
    canceller = await psycopg.AsyncConnection.connect(database_url)
    async with impatient, canceller:
        store = BatchStore(impatient)
        taken = await store.lease_take("w-1", 60.0)
        assert taken is not None
        async with canceller.transaction():
            assert await ApiStore(canceller).job_cancel(client_id=client, job_id=held) is not None
            intent = await store.intent_create(Lease("w-1", taken.token), 60.0, max_requests=10,
                                               model="claude-test", provider="anthropic")
    assert intent is not None and len(intent.items) == 2
    cur = await conn.execute("SELECT status::text, error_code, charged_usd, batch_id IS NOT NULL FROM story_jobs "
                             "ORDER BY id")
    assert await cur.fetchall() == [("failed", "cancelled", Decimal(0), False), ("running", None, None, True),
                                    ("running", None, None, True)]
    assert await count(conn, "SELECT request_count FROM message_batches") == 2
    assert await money_problems(conn) == []


async def _lease_runs_out(pool: AsyncConnectionPool) -> None:
    async with pool.connection() as c:
        await c.execute("UPDATE batch_leases SET until = now() - interval '1 second'")


class _LeaseRunsOutDuringTheCreate(BatchStore):
    """The real store, whose lease has run out (once) when the create's answer
    is recorded: a holder paused during its create call past its lease."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        super().__init__(pool)
        self.ran_out = False

    async def sent(self, *args: Any, **kwargs: Any) -> Any:
        if not self.ran_out:
            self.ran_out = True
            await _lease_runs_out(self._pool)
        return await super().sent(*args, **kwargs)


async def test_a_create_answered_after_the_lease_ran_out_is_logged_as_the_lease_lost_and_adopted_by_listing(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
) -> None:
    """A holder's create is answered once its lease has run out: it records nothing and logs that the lease was
    lost (what an operator reading the log learns), leaving the intent to the next holder, who adopts the batch by
    listing; its story is stored, billed once."""
    client = await client_id_of(conn)
    await enqueue_batch(conn, client, "a slow heron")
    stale = _lane(pool, provider, "w-stale", store=_LeaseRunsOutDuringTheCreate(pool))
    with capture_logs() as logs:
        await stale.tick_once()
    (lost,) = [e for e in logs if e["event"] == "batch.lease_lost"]
    assert lost["provider_batch_id"] == fake.batches[0].id
    assert not [e for e in logs if e["event"] == "batch.already_known"]
    assert await count(conn, "SELECT count(*) FROM message_batches WHERE state = 'intent'") == 1
    fresh = _lane(pool, provider, "w-fresh")
    assert (await fresh.tick_once()).adopted == 1
    fake.end_batch(fake.batches[0].id)
    await fresh.tick_once()
    assert [status for status, _, _ in await _charges(conn)] == ["completed"]
    assert sorted(fake.bills_by_custom_id().values()) == [1]
    assert await money_problems(conn) == []


class _LeaseRunsOutAfterTheIntent(BatchStore):
    """The real store, whose lease runs out once its intent is committed: a
    holder paused between its intent and its create call past its lease;
    taken meanwhile by ``taken_by`` when set."""

    taken_by: str | None = None

    async def intent_create(self, *args: Any, **kwargs: Any) -> Any:
        intent = await super().intent_create(*args, **kwargs)
        await _lease_runs_out(self._pool)
        if self.taken_by is not None:
            assert await BatchStore(self._pool).lease_take(self.taken_by, 60.0) is not None
        return intent


class _LeaseTakenByAnotherAfterTheIntent(_LeaseRunsOutAfterTheIntent):
    taken_by = "w-other"


async def test_only_the_holder_that_made_an_intent_closes_it_as_never_sent_without_the_lease(
    conn: Conn, pool: AsyncConnectionPool,
) -> None:
    """Another holder, which does not hold the lease, cannot close an intent it did not make as never sent: it
    cannot know whether the create was sent, and only a loss declared under the lease may end such an intent."""
    client = await client_id_of(conn)
    await enqueue_batch(conn, client, "a heron in the reeds")
    store = BatchStore(pool)
    taken = await store.lease_take("w-1", 60.0)
    assert taken is not None
    intent = await store.intent_create(Lease("w-1", taken.token), 60.0, max_requests=10, model="m", provider="p")
    assert intent is not None
    await _lease_runs_out(pool)
    answer = await store.refused(Lease("w-2", taken.token + 1), intent.id, outcome="not_sent",
                                 error_code="llm_unavailable", error_text="x", max_attempts=3)
    assert answer.refused == 0
    assert await count(conn, "SELECT count(*) FROM message_batches WHERE state = 'intent'") == 1
    assert await _attempts(conn) == [(1, "started")]


@pytest.mark.parametrize("store_class", [_LeaseRunsOutAfterTheIntent, _LeaseTakenByAnotherAfterTheIntent],
                         ids=["lease-taken-again", "lease-taken-by-another"])
async def test_an_intent_whose_lease_ran_out_before_its_create_is_closed_unbilled_and_its_jobs_wait_again(
    conn: Conn, pool: AsyncConnectionPool, provider: AnthropicBatches, fake: FakeBatches,
    store_class: type[BatchStore],
) -> None:
    """A holder whose lease ran out between its intent and its create call sends nothing, whether it takes the
    lease again under a new token or another holder took it: the intent it made is closed as not sent, each ledger
    row not billed, and its jobs wait for a later batch, however few attempts are allowed: a create never sent
    fails no job and charges nothing. (Left as an intent, the next holder would declare it lost and fail its jobs
    at their worst case.)"""
    client = await client_id_of(conn)
    for n in range(3):
        await enqueue_batch(conn, client, f"an unsent gull {n}")
    lane = _lane(pool, provider, store=store_class(pool))
    assert (await lane.tick_once()).waiting == 3
    assert fake.creates == []
    assert await count(conn, "SELECT count(*) FROM message_batches WHERE state = 'refused'") == 1
    assert await _attempts(conn) == [(1, "not_sent")] * 3
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE status = 'running' "
                             "AND batch_ready_at IS NOT NULL") == 3
    assert await money_problems(conn) == []
