"""The deliverer's records (worker/delivery/store.py)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

import msgspec


class WebhookDeliveryClaim(msgspec.Struct, frozen=True):
    """One claimed attempt: what to send, where, signed with what."""

    id: int
    attempts: int
    # the attempt's lease number: its end is recorded under it, or not at all
    lease: int
    endpoint_id: uuid.UUID
    url: str
    secret: str
    previous_secret: str | None
    endpoint_disabled: bool
    job_public_id: uuid.UUID
    job_status: str
    error_code: str | None
    story_id: uuid.UUID | None
    occurred_at: datetime
    created_at: datetime
    # the job's trace context (W3C), if any: the first attempt joins its trace
    trace_context: Any = None


# how one attempt ended, as webhook_delivery_finish records it
DeliveryOutcome = Literal["delivered", "retry", "dead", "gone"]
