"""Webhook deliveries as the tests make them: an endpoint and an ended job
on Postgres (one delivery per endpoint of its client), and one delivery run
through the real delivery loop on a recording store, to a receiver on this
machine."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg

from api.store import ApiStore
from shared import webhooks
from tests.fakes.recording_delivery_store import RecordingDeliveryStore
from tests.fakes.webhook_receiver import WebhookReceiver
from tests.support.database import enqueue
from tests.support.settings import worker_settings
from tests.support.waiting import wait_until
from worker.delivery.loop import Deliverer


async def new_endpoint(conn: psycopg.AsyncConnection[Any], client_id: int, url: str,
                   secret: str | None = None) -> uuid.UUID:
    """A webhook endpoint of the client for every event: its id."""
    row = await ApiStore(conn).webhook_endpoint_insert(client_id=client_id, url=url, events=webhooks.EVENTS,
                                                       secret=secret or webhooks.new_secret(), max_per_client=10)
    assert row is not None
    return row.id


async def ended_job(conn: psycopg.AsyncConnection[Any], client_id: int) -> uuid.UUID:
    """A job of the client ended (cancelled): one delivery per endpoint of it. Its job_id."""
    job = await enqueue(conn, client_id, "story")
    await ApiStore(conn).job_cancel(client_id=client_id, job_id=job)
    return job


def deliverer_of(store: RecordingDeliveryStore, **settings: Any) -> Deliverer:
    """A deliverer on ``store`` polling every 10 ms, private addresses allowed,
    a 5 s timeout unless ``settings`` say otherwise."""
    return Deliverer(worker_settings(**{"webhook_allow_private": True, "webhook_poll_interval_s": 0.01,
                                        "webhook_timeout_s": 5.0, **settings}), store)


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
