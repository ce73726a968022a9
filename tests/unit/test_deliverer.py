"""The delivery loop on a recording store: what it records for each answer,
and how it meets a database that errs (logged once per episode, backed off
with the worker's one policy, never stopping the loop). The HTTP side is a
real receiver on loopback; no database."""

from __future__ import annotations

import psycopg
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from tests.fakes.recording_delivery_store import Finished, RecordingDeliveryStore
from tests.fakes.webhook_receiver import WebhookReceiver
from tests.support.deliveries import deliver_one, deliverer_of, delivering
from tests.support.waiting import wait_until
from worker.backoff import FIRST_S


async def test_a_delivered_attempt_is_recorded_under_its_lease() -> None:
    """A 2xx answer is recorded as delivered, with the attempt's own lease number."""
    store, delivery_id, receiver = await deliver_one(lease=7)
    assert store.finished == [Finished(delivery_id, 7, "delivered", 204, None)]
    assert [d.verified for d in receiver.deliveries()] == [True]


async def test_a_database_that_errs_is_backed_off_and_logged_once_per_episode() -> None:
    """Claims refused by a read-only database are waited out with the worker's backoff (each wait longer),
    logged once when the episode starts and once when it ends; the delivery then goes."""
    store = RecordingDeliveryStore()
    for _ in range(2):
        store.fail_next("claim", psycopg.errors.ReadOnlySqlTransaction("read-only"))
    with WebhookReceiver() as receiver:
        store.add(receiver.url)
        deliverer = deliverer_of(store)
        with capture_logs() as logs:
            async with delivering(deliverer):
                await wait_until(lambda: bool(store.finished), timeout=20, what="the attempt after the outage")
    events = [e["event"] for e in logs]
    assert events.count("webhook.database_error") == 1 and events.count("webhook.database_recovered") == 1
    (error,) = [e for e in logs if e["event"] == "webhook.database_error"]
    assert error["sqlstate"] == "25006" and error["task"] == "deliverer"
    (recovered,) = [e for e in logs if e["event"] == "webhook.database_recovered"]
    # two waits of the doubling backoff: 0.5 + 1 s
    assert recovered["down_s"] >= FIRST_S * 3 - 0.1
    assert store.finished[0].outcome == "delivered"


async def test_an_attempt_whose_record_fails_is_left_to_its_lease_and_the_loop_goes_on() -> None:
    """A finish the database refuses is logged with its delivery, and the loop records the other attempt:
    the refused one is sent again when its lease runs out (at least once)."""
    store = RecordingDeliveryStore()
    store.fail_next("finish", psycopg.OperationalError("connection lost"))
    with WebhookReceiver() as receiver:
        first, second = store.add(receiver.url), store.add(receiver.url)
        deliverer = deliverer_of(store)
        with capture_logs() as logs:
            async with delivering(deliverer):
                await wait_until(lambda: bool(store.finished), what="the second attempt recorded")
    # the two attempts run at once: whichever records first meets the refusal
    (failed,) = [e for e in logs if e["event"] == "webhook.record_failed"]
    (recorded,) = [f.delivery_id for f in store.finished]
    assert {failed["delivery_id"], recorded} == {first.id, second.id}


async def test_an_attempts_duration_is_what_it_took() -> None:
    """storyjobs_webhook_attempt_duration_seconds observes each attempt's own duration: one attempt to a
    receiver on this machine adds one observation of well under its 5 s timeout."""

    def observed() -> tuple[float, float]:
        name = "storyjobs_webhook_attempt_duration_seconds"
        return (REGISTRY.get_sample_value(f"{name}_count") or 0.0, REGISTRY.get_sample_value(f"{name}_sum") or 0.0)

    count_before, sum_before = observed()
    await deliver_one(lease=1)
    count_after, sum_after = observed()
    assert count_after - count_before == 1
    assert 0 < sum_after - sum_before < 5.0


async def test_a_deliverer_of_one_attempt_at_a_time_still_delivers() -> None:
    """WEBHOOK_CONCURRENCY=1: the one free slot is claimed and the delivery is made."""
    store, delivery_id, _ = await deliver_one(lease=3, webhook_concurrency=1)
    assert store.finished == [Finished(delivery_id, 3, "delivered", 204, None)]
