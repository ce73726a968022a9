"""The delivery loop's bounds and records (worker.delivery.loop, worker.delivery.send):
never more attempts in flight than WEBHOOK_CONCURRENCY, each attempt counted
and logged by how it ended, and no proxy from the environment between the
sender and the address it checked."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from tests.fakes.recording_delivery_store import Finished, RecordingDeliveryStore
from tests.fakes.webhook_receiver import WebhookReceiver
from tests.support.deliveries import deliver_one, deliverer_of, delivering
from tests.support.waiting import wait_until


async def test_no_more_attempts_are_in_flight_than_the_concurrency() -> None:
    """With WEBHOOK_CONCURRENCY 1 and a receiver that hangs, the second due delivery waits for the first
    attempt to end, however many times the loop polls meanwhile."""
    store = RecordingDeliveryStore()
    with WebhookReceiver() as receiver:
        receiver.answer("hang")
        store.add(receiver.url, lease=1)
        store.add(receiver.url, lease=1)
        async with delivering(deliverer_of(store, webhook_concurrency=1)):
            try:
                await wait_until(lambda: receiver.hanging == 1, what="the first attempt to reach the receiver")
                await asyncio.sleep(0.5)  # fifty polls of 10 ms
                assert receiver.hanging == 1
            finally:
                receiver.answer("ok")
            await wait_until(lambda: len(store.finished) == 2, what="both attempts recorded")


def _deliveries(outcome: str) -> float:
    return REGISTRY.get_sample_value("storyjobs_webhook_deliveries_total", {"outcome": outcome}) or 0.0


async def test_a_delivered_attempt_is_counted_and_logged_as_delivered() -> None:
    before = {outcome: _deliveries(outcome) for outcome in ("delivered", "lost")}
    with capture_logs() as logs:
        store, delivery_id, _ = await deliver_one(lease=2)
    assert store.finished == [Finished(delivery_id, 2, "delivered", 204, None)]
    assert {outcome: _deliveries(outcome) - before[outcome] for outcome in before} == {"delivered": 1.0, "lost": 0.0}
    assert [e["event"] for e in logs].count("webhook.delivered") == 1


async def test_a_proxy_named_by_the_environment_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP(S)_PROXY and ALL_PROXY naming a port where nothing answers change nothing: the sender connects to
    the address the URL rule checked, itself."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    store, delivery_id, receiver = await deliver_one(lease=1)
    assert store.finished == [Finished(delivery_id, 1, "delivered", 204, None)]
    assert len(receiver.deliveries()) == 1
