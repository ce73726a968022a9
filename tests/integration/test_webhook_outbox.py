"""The webhook outbox: every way a job ends writes its event in the same
statement, only for clients with endpoints; deliveries are leased, finished
under a guard, retried, killed by a 410, and pruned with their jobs."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from api.store import ApiStore
from shared import webhooks
from shared.console_store import ConsoleStore
from shared.status import ErrorCode, LlmOutcome
from shared.store import job_cancel
from sweeper.store import PgSweeperStore
from sweeper.sweep import Sweeper
from tests.support import worker_statements
from tests.support.database import client_id_of, count, enqueue, story_written
from tests.support.settings import LATER, SWEEP, sweeper_settings
from worker.delivery.store import PgDeliveryStore
from worker.rows import Failure


async def _endpoint(conn: psycopg.AsyncConnection[Any], client_id: int, events: tuple[str, ...] = webhooks.EVENTS,
                    url: str = "https://hooks.example.com/in") -> uuid.UUID:
    row = await ApiStore(conn).webhook_endpoint_insert(client_id=client_id, url=url, events=events,
                                                       secret=webhooks.new_secret(), max_per_client=10)
    assert row is not None
    return row.id


async def _events(conn: psycopg.AsyncConnection[Any]) -> list[tuple[int, str, str | None]]:
    cur = await conn.execute("SELECT job_id, job_status::text, error_code FROM webhook_deliveries ORDER BY job_id")
    return [(int(r[0]), str(r[1]), r[2]) for r in await cur.fetchall()]


async def _claim_all(conn: psycopg.AsyncConnection[Any], n: int) -> list[int]:
    result = await worker_statements.job_claim(conn, worker_id="w1", claim_limit=n,
                                              provider="offline", model="offline-writer")
    return [job.id for job in result.claimed]


async def test_every_end_of_a_job_writes_its_event(conn: psycopg.AsyncConnection[Any]) -> None:
    """Completion, a worker's failure, a client's and an operator's cancel and a sweep each write one event."""
    client = await client_id_of(conn)
    await _endpoint(conn, client)
    ids = [await enqueue(conn, client, f"story {n}") for n in range(6)]
    held = await _claim_all(conn, 3)
    assert await _events(conn) == [], "a claim is no end"
    await worker_statements.job_settle(conn, worker_id="w1", completions=[story_written(held[0])])
    await worker_statements.job_fail_running(conn, worker_id="w1", failures=[Failure(
        job_id=held[1], attempt=1, error_code=ErrorCode.LLM_ERROR, error_text="boom",
        call_outcome=LlmOutcome.FAILED, billed=True)])
    assert (await ApiStore(conn).job_cancel(client_id=client, job_id=ids[2])) is not None
    assert (await job_cancel(conn, client_id=None, job_id=ids[3])) is not None
    await PgSweeperStore(conn).fail_stale(now=LATER, **SWEEP)
    assert await _events(conn) == [
        (1, "completed", None), (2, "failed", "llm_error"), (3, "failed", "cancelled"), (4, "failed", "cancelled"),
        (5, "failed", "queue_timeout"), (6, "failed", "queue_timeout")]


async def test_a_client_without_endpoints_gets_no_event(conn: psycopg.AsyncConnection[Any]) -> None:
    """Only the jobs of the client with an endpoint write events; a disabled one or an unwanted event writes none."""
    with_endpoint, without, disabled = [await client_id_of(conn, name) for name in ("a", "b", "c")]
    await _endpoint(conn, with_endpoint, events=("job.cancelled",))
    await conn.execute("UPDATE webhook_endpoints SET disabled_at = now() WHERE id = %s",
                       (await _endpoint(conn, disabled),))
    jobs = {client: await enqueue(conn, client, "story") for client in (with_endpoint, without, disabled)}
    for client, job in jobs.items():
        await ApiStore(conn).job_cancel(client_id=client, job_id=job)
    await enqueue(conn, with_endpoint, "completed, not wanted")
    (held,) = await _claim_all(conn, 1)
    await worker_statements.job_settle(conn, worker_id="w1", completions=[story_written(held)])
    assert await count(conn, "SELECT count(*) FROM story_jobs WHERE status = 'completed'") == 1
    assert await _events(conn) == [(1, "failed", "cancelled")]


async def test_a_claimed_delivery_is_leased_and_its_stale_attempt_records_nothing(
        conn: psycopg.AsyncConnection[Any]) -> None:
    """A claimed delivery is not claimed again until its lease ends; then the first attempt's record is refused."""
    client = await client_id_of(conn)
    await _endpoint(conn, client)
    await ApiStore(conn).job_cancel(client_id=client, job_id=await enqueue(conn, client, "story"))
    (first,) = await PgDeliveryStore(conn).claim(limit=10, lease_s=60)
    assert first.attempts == 1 and first.job_status == "failed" and first.error_code == "cancelled"
    assert await PgDeliveryStore(conn).claim(limit=10, lease_s=60) == []
    # the lease ends
    await conn.execute("UPDATE webhook_deliveries SET next_attempt_at = now() - interval '1 second'")
    (second,) = await PgDeliveryStore(conn).claim(limit=10, lease_s=60)
    assert second.id == first.id and second.attempts == 2
    assert await PgDeliveryStore(conn).finish(delivery_id=first.id, lease=first.lease, outcome="delivered") is None
    assert await PgDeliveryStore(conn).finish(delivery_id=second.id, lease=second.lease, outcome="delivered") is not None
    assert await count(conn, "SELECT count(*) FROM webhook_deliveries WHERE state = 'delivered'") == 1


async def test_a_failed_attempt_is_due_again_after_its_wait_and_dead_ends_mark_the_endpoint(
        conn: psycopg.AsyncConnection[Any]) -> None:
    """retry sets the next attempt; dead marks the endpoint failing; a later success clears it."""
    client = await client_id_of(conn)
    endpoint = await _endpoint(conn, client)
    for n in range(2):
        await ApiStore(conn).job_cancel(client_id=client, job_id=await enqueue(conn, client, f"story {n}"))
    first, second = await PgDeliveryStore(conn).claim(limit=10, lease_s=60)
    await PgDeliveryStore(conn).finish(delivery_id=first.id, lease=first.lease, outcome="retry", retry_in_s=300,
                                       status_code=500, error="HTTP 500")
    due_in = await count(conn, "SELECT extract(epoch FROM next_attempt_at - now())::int FROM webhook_deliveries "
                               "WHERE id = %s", first.id)
    assert 290 <= due_in <= 300
    await PgDeliveryStore(conn).finish(delivery_id=second.id, lease=second.lease, outcome="dead", error="HTTP 500")
    (row,) = await ConsoleStore(conn).webhooks.webhook_endpoint_list()
    assert row.id == endpoint and row.failing_since is not None and (row.pending, row.dead) == (1, 1)
    assert await ConsoleStore(conn).webhooks.webhook_delivery_retry(delivery_id=second.id) is not None
    assert await ConsoleStore(conn).webhooks.webhook_delivery_retry(delivery_id=second.id) is None, "only a dead delivery is retried"
    (again,) = await PgDeliveryStore(conn).claim(limit=10, lease_s=60)
    assert again.id == second.id and again.attempts == 1
    await PgDeliveryStore(conn).finish(delivery_id=again.id, lease=again.lease, outcome="delivered", status_code=200)
    (row,) = await ConsoleStore(conn).webhooks.webhook_endpoint_list()
    assert row.failing_since is None


async def test_a_410_disables_the_endpoint_and_drops_its_other_deliveries(conn: psycopg.AsyncConnection[Any]) -> None:
    """gone disables the endpoint, kills its undelivered deliveries, and later ends write no event for it."""
    client = await client_id_of(conn)
    await _endpoint(conn, client)
    for n in range(3):
        await ApiStore(conn).job_cancel(client_id=client, job_id=await enqueue(conn, client, f"story {n}"))
    (first,) = await PgDeliveryStore(conn).claim(limit=1, lease_s=60)
    await PgDeliveryStore(conn).finish(delivery_id=first.id, lease=first.lease, outcome="gone", status_code=410)
    assert await count(conn, "SELECT count(*) FROM webhook_deliveries WHERE state = 'dead'") == 3
    assert await count(conn, "SELECT count(*) FROM webhook_endpoints WHERE disabled_at IS NOT NULL") == 1
    await ApiStore(conn).job_cancel(client_id=client, job_id=await enqueue(conn, client, "after"))
    assert await count(conn, "SELECT count(*) FROM webhook_deliveries") == 3


async def test_deliveries_are_pruned_with_their_jobs(conn: psycopg.AsyncConnection[Any]) -> None:
    """The sweeper's prune deletes a finished job's ended deliveries with it, and only those."""
    client = await client_id_of(conn)
    await _endpoint(conn, client)
    old, recent = [await enqueue(conn, client, f"story {n}") for n in range(2)]
    for job in (old, recent):
        await ApiStore(conn).job_cancel(client_id=client, job_id=job)
    await conn.execute("UPDATE webhook_deliveries SET state = 'delivered', delivered_at = now()")
    await conn.execute("UPDATE story_jobs SET created_at = now() - interval '40 days', completed_at = now() - interval '40 days' "
                       "WHERE public_id = %s", (old,))
    pruned = len(await PgSweeperStore(conn).prune_finished(retention_s=30 * 86400, batch_size=100))
    assert pruned == 1
    cur = await conn.execute("SELECT job_public_id FROM webhook_deliveries")
    assert [r[0] for r in await cur.fetchall()] == [recent]


async def test_a_job_is_not_pruned_while_one_of_its_deliveries_is_pending(conn: psycopg.AsyncConnection[Any]) -> None:
    """Past retention, a job with a delivery still pending is kept with it until the delivery is dead."""
    client = await client_id_of(conn)
    for n in range(2):
        await _endpoint(conn, client, url=f"https://hooks.example.com/{n}")
    job = await enqueue(conn, client, "story")
    await ApiStore(conn).job_cancel(client_id=client, job_id=job)
    # one endpoint got it, the other's delivery is still being retried
    await conn.execute("UPDATE webhook_deliveries SET state = 'delivered', delivered_at = now() "
                       "WHERE id = (SELECT min(id) FROM webhook_deliveries)")
    await conn.execute("UPDATE story_jobs SET created_at = now() - interval '40 days', completed_at = now() - interval '40 days'")
    assert len(await PgSweeperStore(conn).prune_finished(retention_s=30 * 86400, batch_size=100)) == 0
    assert await count(conn, "SELECT count(*) FROM webhook_deliveries WHERE state = 'pending'") == 1
    await conn.execute("UPDATE webhook_deliveries SET state = 'dead' WHERE state = 'pending'")
    assert len(await PgSweeperStore(conn).prune_finished(retention_s=30 * 86400, batch_size=100)) == 1
    assert await count(conn, "SELECT count(*) FROM webhook_deliveries") == 0


async def test_the_sweeper_gauge_reads_the_oldest_undelivered_event(conn: psycopg.AsyncConnection[Any]) -> None:
    """The gauges count undelivered rows and the age of the oldest, by the caller's clock."""
    client = await client_id_of(conn)
    await _endpoint(conn, client)
    empty = await PgSweeperStore(conn).webhook_delivery_gauges()
    assert (empty.undelivered, empty.oldest_undelivered_age_seconds) == (0, 0)
    await ApiStore(conn).job_cancel(client_id=client, job_id=await enqueue(conn, client, "story"))
    gauges = await PgSweeperStore(conn).webhook_delivery_gauges(now=datetime.now(UTC) + timedelta(minutes=10))
    assert gauges.undelivered == 1 and 590 < gauges.oldest_undelivered_age_seconds < 610


async def test_a_sweep_exports_the_outbox_gauges(conn: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool) -> None:
    """After a pass, the sweeper's gauges say how many events wait and how old the oldest is."""
    client = await client_id_of(conn)
    await _endpoint(conn, client)
    for n in range(2):
        await ApiStore(conn).job_cancel(client_id=client, job_id=await enqueue(conn, client, f"story {n}"))
    await Sweeper(sweeper_settings(), PgSweeperStore(pool)).sweep_once(now=datetime.now(UTC) + timedelta(minutes=5))
    assert REGISTRY.get_sample_value("storyjobs_webhook_undelivered") == 2
    age = REGISTRY.get_sample_value("storyjobs_webhook_oldest_undelivered_age_seconds")
    assert age is not None and 290 < age < 310


async def test_jobs_kept_for_their_deliveries_never_stall_the_prune_behind_them(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """More jobs kept past retention (a delivery still pending) than a prune batch, at the head of the table: the
    prune walks past them to the expired jobs behind, and keeps them until their deliveries end."""
    client = await client_id_of(conn)
    await _endpoint(conn, client)
    jobs = [await enqueue(conn, client, f"story {n}") for n in range(8)]
    for job in jobs:
        await ApiStore(conn).job_cancel(client_id=client, job_id=job)
    kept, expired = jobs[:5], jobs[5:]
    await conn.execute("UPDATE webhook_deliveries SET state = 'delivered', delivered_at = now() "
                       "WHERE job_public_id = ANY(%s)", (expired,))
    await conn.execute("UPDATE story_jobs SET created_at = now() - interval '40 days', "
                       "completed_at = now() - interval '40 days'")
    assert len(await PgSweeperStore(conn).prune_finished(retention_s=30 * 86400, batch_size=3)) == 3
    cur = await conn.execute("SELECT public_id FROM story_jobs ORDER BY id")
    assert [r[0] for r in await cur.fetchall()] == kept
    assert len(await PgSweeperStore(conn).prune_finished(retention_s=30 * 86400, batch_size=3)) == 0
