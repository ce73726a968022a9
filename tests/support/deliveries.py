"""One webhook delivery run through the real delivery loop on a recording
store, to a receiver on this machine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from tests.fakes.recording_delivery_store import RecordingDeliveryStore
from tests.fakes.webhook_receiver import WebhookReceiver
from tests.support.settings import worker_settings
from tests.support.waiting import wait_until
from worker.delivery.loop import Deliverer


def deliverer_of(store: RecordingDeliveryStore, **settings: Any) -> Deliverer:
    return Deliverer(worker_settings(webhook_allow_private=True, webhook_poll_interval_s=0.01, webhook_timeout_s=5.0,
                                     **settings), store)


@asynccontextmanager
async def delivering(deliverer: Deliverer) -> AsyncIterator[None]:
    """The deliverer's loop running for the block, stopped and ended after it."""
    running = asyncio.create_task(deliverer.run())
    try:
        yield
    finally:
        deliverer.stop()
        await running


async def deliver_one(lease: int, *, answer: str | None = None,
                      **settings: Any) -> tuple[RecordingDeliveryStore, int, WebhookReceiver]:
    """One signed delivery, run until its attempt is recorded, to a receiver
    answering as ``answer`` says (a mode of WebhookReceiver.answer; default
    204): the store, the delivery's id and the receiver."""
    store = RecordingDeliveryStore()
    with WebhookReceiver() as receiver:
        if answer is not None:
            receiver.answer(answer)
        secret = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
        receiver.secrets.append(secret)
        delivery = store.add(receiver.url, secret=secret, lease=lease)
        async with delivering(deliverer_of(store, **settings)):
            await wait_until(lambda: bool(store.finished), what="the attempt recorded")
    return store, delivery.id, receiver
