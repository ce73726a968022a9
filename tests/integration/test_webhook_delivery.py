"""The delivery loop and its statements on Postgres: whatever an attempt
raises is recorded and the delivery ends; the claim never goes past the
schedule and shares its slots between clients; a finish is checked against
its attempt's lease, which no operator's retry gives back."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
import structlog
from psycopg_pool import AsyncConnectionPool

from shared import webhooks
from shared.console_store import ConsoleStore
from tests.fakes.webhook_receiver import WebhookReceiver
from tests.support.database import client_id_of, count
from tests.support.deliveries import delivering, ended_job, new_endpoint
from tests.support.settings import worker_settings
from tests.support.waiting import wait_until
from worker.delivery.loop import Deliverer
from worker.delivery.store import PgDeliveryStore

Conn = psycopg.AsyncConnection[Any]


async def _lapse_leases(conn: Conn) -> None:
    """Every lease runs out now, as when the worker holding it was killed."""
    await conn.execute("UPDATE webhook_deliveries SET next_attempt_at = now() - interval '1 second', "
                       "leased_until = now() - interval '1 second' WHERE state = 'pending' AND leased_until IS NOT NULL")


async def _state(conn: Conn, delivery_id: int) -> tuple[str, int, str | None]:
    cur = await conn.execute("SELECT state, attempts, last_error FROM webhook_deliveries WHERE id = %s",
                             (delivery_id,))
    row = await cur.fetchone()
    assert row is not None
    return str(row[0]), int(row[1]), row[2]


# (a URL httpx cannot parse, the first case found, is now refused by the URL
# rule itself: tests/unit/test_webhook_address_rule.py)
@pytest.mark.parametrize("url, secret", [
    # a stored secret that is not base64: signing raises binascii.Error, which no rule foresaw
    ("http://127.0.0.1:{port}/hook", "whsec_a"),
], ids=["secret-not-base64"])
async def test_an_attempt_that_raises_anything_is_recorded_and_the_delivery_ends_dead(
        conn: Conn, pool: AsyncConnectionPool, url: str, secret: str | None) -> None:
    """An attempt raising what no rule foresaw is a failed attempt, recorded with its error and logged once
    with the delivery and job; after the schedule the delivery is dead, and another client's webhook goes."""
    broken, fine = await client_id_of(conn, "broken"), await client_id_of(conn, "fine")
    with WebhookReceiver() as receiver:
        await new_endpoint(conn, broken, url.format(port=receiver.port), secret)
        fine_secret = webhooks.new_secret()
        receiver.secrets.append(fine_secret)
        await new_endpoint(conn, fine, receiver.url, fine_secret)
        broken_job = await ended_job(conn, broken)
        await ended_job(conn, fine)
        (bad_id,) = [r[0] for r in await (await conn.execute(
            "SELECT id FROM webhook_deliveries WHERE client_id = %s", (broken,))).fetchall()]
        # the schedule at 1/100,000: eight attempts within about a second
        deliverer = Deliverer(worker_settings(webhook_allow_private=True, webhook_retry_scale=0.00001,
                                              webhook_timeout_s=2.0, webhook_poll_interval_s=0.05),
                              PgDeliveryStore(pool))
        with structlog.testing.capture_logs() as logs:
            async with delivering(deliverer):
                await wait_until(lambda: _ended(conn, bad_id), timeout=20, what="the broken delivery ended")
                await wait_until(lambda: len(receiver.deliveries()) == 1, what="the other client's webhook")
    state, attempts, last_error = await _state(conn, bad_id)
    assert (state, attempts) == ("dead", webhooks.MAX_ATTEMPTS)
    assert last_error is not None and last_error.startswith("unexpected ")
    raised = [e for e in logs if e["event"] == "webhook.attempt_raised"]
    assert len(raised) == webhooks.MAX_ATTEMPTS, raised
    assert {(e["delivery_id"], e["job_id"]) for e in raised} == {(bad_id, str(broken_job))}
    assert [e["attempt"] for e in raised] == list(range(1, webhooks.MAX_ATTEMPTS + 1))
    assert not [e for e in logs if e["event"] == "webhook.delivery_task_failed"]


async def _ended(conn: Conn, delivery_id: int) -> bool:
    return (await _state(conn, delivery_id))[0] != "pending"


async def test_the_claim_never_takes_a_delivery_past_the_schedule(conn: Conn) -> None:
    """A delivery due again after its last attempt (its worker died, or its attempts ran to the counter's
    end) is dead, its endpoint failing, and never claimed; the other due deliveries are."""
    client = await client_id_of(conn)
    endpoint = await new_endpoint(conn, client, "https://hooks.example.com/in")
    for _ in range(3):
        await ended_job(conn, client)
    await conn.execute("UPDATE webhook_deliveries SET attempts = CASE id WHEN 1 THEN %s WHEN 2 THEN 32767 ELSE 0 END, "
                       "lease = 5", (webhooks.MAX_ATTEMPTS,))
    claimed = await PgDeliveryStore(conn).claim(limit=10, lease_s=60)
    assert [(c.id, c.attempts) for c in claimed] == [(3, 1)]
    cur = await conn.execute("SELECT id, state, attempts, leased_until IS NULL FROM webhook_deliveries ORDER BY id")
    assert await cur.fetchall() == [(1, "dead", webhooks.MAX_ATTEMPTS, True), (2, "dead", 32767, True),
                                    (3, "pending", 1, False)]
    assert await count(conn, "SELECT count(*) FROM webhook_endpoints WHERE id = %s AND failing_since IS NOT NULL",
                       endpoint) == 1


async def test_an_attempt_whose_lease_lapsed_is_taken_again_up_to_the_schedule_and_then_dies(conn: Conn) -> None:
    """A worker killed at every attempt: the delivery is claimed at most MAX_ATTEMPTS times, then dead."""
    client = await client_id_of(conn)
    await new_endpoint(conn, client, "https://hooks.example.com/in")
    await ended_job(conn, client)
    seen = []
    for _ in range(webhooks.MAX_ATTEMPTS + 3):
        seen += [c.attempts for c in await PgDeliveryStore(conn).claim(limit=1, lease_s=60)]
        await _lapse_leases(conn)
    assert seen == list(range(1, webhooks.MAX_ATTEMPTS + 1))
    assert (await _state(conn, 1))[:2] == ("dead", webhooks.MAX_ATTEMPTS)


async def test_a_late_attempt_cannot_record_onto_the_attempts_after_an_operators_retry(conn: Conn) -> None:
    """An attempt that outlived its lease, across a retry by an operator that starts the schedule again, finds
    its lease gone: its end changes nothing, and the attempt in flight records its own."""
    client = await client_id_of(conn)
    await new_endpoint(conn, client, "https://hooks.example.com/in")
    await ended_job(conn, client)
    (late,) = await PgDeliveryStore(conn).claim(limit=1, lease_s=60)
    await _lapse_leases(conn)
    (second,) = await PgDeliveryStore(conn).claim(limit=1, lease_s=60)
    assert await PgDeliveryStore(conn).finish(delivery_id=second.id, lease=second.lease, outcome="dead",
                                              status_code=500, error="HTTP 500") is not None
    assert await ConsoleStore(conn).webhooks.webhook_delivery_retry(delivery_id=second.id) is not None
    (fresh,) = await PgDeliveryStore(conn).claim(limit=1, lease_s=60)
    assert fresh.attempts == late.attempts == 1
    assert await PgDeliveryStore(conn).finish(delivery_id=late.id, lease=late.lease,
                                              outcome="delivered", status_code=200) is None
    assert await _state(conn, fresh.id) == ("pending", 1, None)
    assert await PgDeliveryStore(conn).finish(delivery_id=fresh.id, lease=fresh.lease, outcome="retry",
                                              retry_in_s=5, status_code=503, error="HTTP 503") is not None
    # recorded once: the same end again finds no attempt in flight
    assert await PgDeliveryStore(conn).finish(delivery_id=fresh.id, lease=fresh.lease,
                                              outcome="delivered", status_code=200) is None
    assert (await _state(conn, fresh.id))[0] == "pending"


async def test_the_claim_serves_the_client_with_the_fewest_attempts_in_flight_first(conn: Conn) -> None:
    """A client holding four attempts with twenty more due yields the next slot to another client's one
    delivery, though it became due last; with slots for all, each client's first due comes before seconds."""
    hung, other = await client_id_of(conn, "hung"), await client_id_of(conn, "other")
    for n in range(4):
        await new_endpoint(conn, hung, f"https://hooks.example.com/{n}")
    await new_endpoint(conn, other, "https://other.example.com/in")
    for _ in range(6):
        await ended_job(conn, hung)
    held = await PgDeliveryStore(conn).claim(limit=4, lease_s=60)
    assert len(held) == 4
    await ended_job(conn, other)
    (next_one,) = await PgDeliveryStore(conn).claim(limit=1, lease_s=60)
    cur = await conn.execute("SELECT client_id FROM webhook_deliveries WHERE id = %s", (next_one.id,))
    assert await cur.fetchone() == (other,)
    # the hung client's attempts end; another event of the other client; two slots: one each
    for claim in held:
        await PgDeliveryStore(conn).finish(delivery_id=claim.id, lease=claim.lease, outcome="retry",
                                           retry_in_s=3600, error="no answer")
    await PgDeliveryStore(conn).finish(delivery_id=next_one.id, lease=next_one.lease,
                                       outcome="delivered", status_code=200)
    await ended_job(conn, other)
    pair = await PgDeliveryStore(conn).claim(limit=2, lease_s=60)
    cur = await conn.execute("SELECT client_id FROM webhook_deliveries WHERE id = ANY(%s) ORDER BY client_id",
                             ([c.id for c in pair],))
    assert [r[0] for r in await cur.fetchall()] == sorted([hung, other])
