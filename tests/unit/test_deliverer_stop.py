"""A deliverer told to stop (worker.delivery.loop) lets each attempt in
flight run to its own WEBHOOK_TIMEOUT_S and records how it ended, rather
than abandoning it to its lease: an attempt the receiver never answered
is recorded now, to be retried on its schedule."""

from __future__ import annotations

import asyncio

from tests.fakes.recording_delivery_store import RecordingDeliveryStore
from tests.fakes.webhook_receiver import WebhookReceiver
from tests.support.deliveries import deliverer_of
from tests.support.waiting import wait_until
from worker.delivery.rows import DeliveryOutcome


async def test_an_attempt_in_flight_at_stop_runs_to_its_timeout_and_is_recorded() -> None:
    """Stopped while its only attempt waits on a receiver that never answers, the deliverer records the
    attempt at its 2 s timeout (to be retried), then stops."""
    store = RecordingDeliveryStore()
    with WebhookReceiver() as receiver:
        receiver.answer("hang")
        store.add(receiver.url, lease=1)
        deliverer = deliverer_of(store, webhook_timeout_s=2.0)
        running = asyncio.create_task(deliverer.run())
        try:
            await wait_until(lambda: receiver.hanging == 1, what="the attempt to reach the receiver")
            deliverer.stop()
            await asyncio.wait_for(running, timeout=10)
        finally:
            receiver.answer("ok")
    assert [(f.lease, f.outcome) for f in store.finished] == [(1, "retry")]


class _StuckStore(RecordingDeliveryStore):
    """A store whose record of an attempt never answers (a database that hangs): the attempt cannot end."""

    def __init__(self) -> None:
        super().__init__()
        self.recording = asyncio.Event()
        self.cancelled = False

    async def finish(self, delivery_id: int, lease: int, outcome: DeliveryOutcome, *, retry_in_s: float = 0.0,
                     status_code: int | None = None, error: str | None = None) -> float | None:
        self.recording.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return None


async def test_an_attempt_still_running_a_second_past_its_timeout_is_cancelled_when_the_deliverer_stops() -> None:
    """Stopped while an attempt's record hangs, the deliverer waits WEBHOOK_TIMEOUT_S and a second, then
    cancels the attempt (its lease makes it due again) rather than leave it running behind it."""
    store = _StuckStore()
    with WebhookReceiver() as receiver:
        store.add(receiver.url, lease=1)
        deliverer = deliverer_of(store, webhook_timeout_s=1.0)
        running = asyncio.create_task(deliverer.run())
        await wait_until(store.recording.is_set, what="the attempt's record to hang")
        deliverer.stop()
        await asyncio.wait_for(running, timeout=10)
        await asyncio.sleep(0.1)  # the cancellation lands at the attempt's next step
    assert store.cancelled
