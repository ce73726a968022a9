"""A deliverer told to stop (worker.delivery.loop) lets each attempt in
flight run to its own WEBHOOK_TIMEOUT_S and records how it ended, rather
than abandoning it to its lease: an attempt the receiver never answered
is recorded now, to be retried on its schedule."""

from __future__ import annotations

import asyncio

from tests.fakes.recording_delivery_store import RecordingDeliveryStore
from tests.fakes.webhook_receiver import WebhookReceiver
from tests.support.settings import worker_settings
from tests.support.waiting import wait_until
from worker.delivery.loop import Deliverer


async def test_an_attempt_in_flight_at_stop_runs_to_its_timeout_and_is_recorded() -> None:
    """Stopped while its only attempt waits on a receiver that never answers, the deliverer records the
    attempt at its 2 s timeout (to be retried), then stops."""
    store = RecordingDeliveryStore()
    with WebhookReceiver() as receiver:
        receiver.answer("hang")
        store.add(receiver.url, lease=1)
        deliverer = Deliverer(worker_settings(webhook_allow_private=True, webhook_poll_interval_s=0.01,
                                              webhook_timeout_s=2.0), store)
        running = asyncio.create_task(deliverer.run())
        try:
            await wait_until(lambda: receiver.hanging == 1, what="the attempt to reach the receiver")
            deliverer.stop()
            await asyncio.wait_for(running, timeout=10)
        finally:
            receiver.answer("ok")
    assert [(f.lease, f.outcome) for f in store.finished] == [(1, "retry")]
