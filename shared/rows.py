"""The rows that more than one caller reads (shared/store.py's queries, the
console's and the sweeper's alike), and the worker's (worker/store.py).

Each caller keeps its own rows beside its store: api/rows.py,
shared/console_rows.py, sweeper/rows.py."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal
from typing import Any, Literal

import msgspec

from shared.pricing import Price
from shared.ratelimit import LimiterState
from shared.status import ErrorCode, JobStatus, LlmOutcome


class KeyAuth(msgspec.Struct, frozen=True):
    """The authentication part of every api lookup."""

    client_id: int
    key_hash: bytes
    revoked: bool


class CancelResult(msgspec.Struct, frozen=True):
    previous_status: JobStatus
    cancelled: bool


class ClaimedJob(msgspec.Struct, frozen=True):
    """A job this worker now owns; its claim wrote ledger row (id, attempt 1)."""

    id: int
    public_id: uuid.UUID
    client_id: int
    request: dict[str, Any]
    created_at: datetime
    started_at: datetime
    # fixed when the job was accepted; None for jobs accepted before they were
    max_tokens: int | None = None
    input_tokens_estimate: int | None = None
    # the model and prices its reservation assumed; None for jobs accepted
    # before they were
    model: str | None = None
    input_usd_per_mtok: Decimal | None = None
    output_usd_per_mtok: Decimal | None = None

    def price(self) -> Price | None:
        """The prices the job's reservation assumed, if it carries them."""
        if self.input_usd_per_mtok is None or self.output_usd_per_mtok is None:
            return None
        return Price(self.input_usd_per_mtok, self.output_usd_per_mtok)


class Draft(msgspec.Struct, frozen=True, kw_only=True):
    """A story as a writer returns it, with what its call cost."""

    title: str
    body: str
    model: str
    prompt_version: str
    input_tokens: int
    output_tokens: int
    cost_usd: Decimal
    request_id: str | None = None


class Completion(Draft, frozen=True, kw_only=True):
    """A written story, waiting to complete its job."""

    job_id: int
    client_id: int
    attempt: int


class Failure(msgspec.Struct, frozen=True):
    """A job its worker gives up on, with how its last LLM call ended."""

    job_id: int
    attempt: int
    error_code: ErrorCode
    error_text: str
    call_outcome: LlmOutcome
    billed: bool
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: Decimal = Decimal(0)
    request_id: str | None = None


class RetryStart(msgspec.Struct, frozen=True):
    """What asking to open a retry's ledger row gave: its attempt; or, while
    the shared rate bucket is paused, no row and how long to wait before
    asking again; or, when the job is no longer ours, nothing."""

    attempt: int | None
    paused_s: float
    owned: bool


class SettleResult(msgspec.Struct, frozen=True):
    completed_ids: list[int]
    already_completed_ids: list[int]
    claimed: list[ClaimedJob]
    limiter: LimiterState = LimiterState()


class HeartbeatRow(msgspec.Struct, frozen=True):
    id: int
    status: JobStatus | None
    error_code: ErrorCode | None
    alive: bool


# -- read by the console and the sweeper ---------------------------------------------


class JobIdBounds(msgspec.Struct, frozen=True):
    """Every job created in the asked time range has lo_id <= id < hi_id."""

    lo_id: int
    hi_id: int


class BudgetDay(msgspec.Struct, frozen=True):
    """Today's spend of all clients (scope 'all', client_id 0) or of one."""

    scope: str
    client_id: int
    spent_usd: Decimal
    reserved_usd: Decimal
    client_budget_usd: Decimal | None


# The wait and run time buckets' lower bounds, in seconds: a minute_rollup
# row holds how many jobs fell in each, so that percentiles over any range
# are sums of rows (to the bucket's bound; api/ops/history.py reads them).
ROLLUP_BOUNDS_S: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0,
                                      120.0, 180.0, 300.0, 450.0, 600.0, 900.0, 1200.0, 1800.0, 3600.0)


# -- webhooks ---------------------------------------------------------------


class WebhookEndpointRow(msgspec.Struct, frozen=True):
    """A client's endpoint as the client sees it: never its secret."""

    id: uuid.UUID
    url: str
    events: list[str]
    created_at: datetime
    # it answered 410 Gone: nothing more is sent to it
    disabled_at: datetime | None
    # a delivery ran out of retries; cleared by the next success
    failing_since: datetime | None


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


# how one attempt ended, as webhook_delivery_finish records it
DeliveryOutcome = Literal["delivered", "retry", "dead", "gone"]
