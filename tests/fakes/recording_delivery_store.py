"""An in-memory DeliveryStore that hands out the claims a test queued and
records every finish, for the delivery loop's rules without a database (the
statements' leases, schedule and fair turns are proven on Postgres:
tests/integration/test_webhook_delivery.py, tests/model/)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from shared import webhooks
from worker.delivery.rows import DeliveryOutcome, WebhookDeliveryClaim

if TYPE_CHECKING:
    from worker.delivery.store import DeliveryStore


@dataclass(frozen=True)
class Finished:
    delivery_id: int
    lease: int
    outcome: DeliveryOutcome
    status_code: int | None
    error: str | None


class RecordingDeliveryStore:
    def __init__(self) -> None:
        self.due: list[WebhookDeliveryClaim] = []
        self.finished: list[Finished] = []
        self.claims: list[int] = []  # the limit each claim asked for
        self._failures: dict[str, list[Exception]] = {}

    def add(self, url: str, *, secret: str | None = None, lease: int = 1) -> WebhookDeliveryClaim:
        """A due delivery of a cancelled job to ``url``, handed out by the next claim."""
        now = datetime.now(UTC)
        claim = WebhookDeliveryClaim(
            id=len(self.due) + len(self.finished) + 1, attempts=1, lease=lease, endpoint_id=uuid.uuid4(), url=url,
            secret=secret or webhooks.new_secret(), previous_secret=None, endpoint_disabled=False,
            job_public_id=uuid.uuid4(), job_status="failed", error_code="cancelled", story_id=None,
            occurred_at=now, created_at=now)
        self.due.append(claim)
        return claim

    def fail_next(self, method: str, error: Exception) -> None:
        self._failures.setdefault(method, []).append(error)

    def _fail(self, method: str) -> None:
        failures = self._failures.get(method)
        if failures:
            raise failures.pop(0)

    async def claim(self, limit: int, lease_s: float) -> list[WebhookDeliveryClaim]:
        self.claims.append(limit)
        self._fail("claim")
        taken, self.due = self.due[:limit], self.due[limit:]
        return taken

    async def finish(self, delivery_id: int, lease: int, outcome: DeliveryOutcome, *, retry_in_s: float = 0.0,
                     status_code: int | None = None, error: str | None = None) -> float | None:
        self._fail("finish")
        self.finished.append(Finished(delivery_id, lease, outcome, status_code, error))
        return 0.01


if TYPE_CHECKING:
    # mypy holds the fake to the protocol the deliverer takes
    _: DeliveryStore = RecordingDeliveryStore()
