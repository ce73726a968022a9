"""The worker's records: what its store's statements take and answer
(worker/store.py), and what a writer returns."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal
from typing import Any

import msgspec

from shared.pricing import Price
from shared.ratelimit import LimiterState
from shared.status import ErrorCode, JobStatus, LlmOutcome


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
    # the trace context of the span that admitted it (W3C), if any: its run
    # joins that trace (shared/telemetry.py reads it, whatever it holds)
    trace_context: Any = None

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
    """What settling written stories did: completed now, or (after an
    ambiguous commit) already completed by this worker; any other is a
    lost race."""

    completed_ids: list[int]
    already_completed_ids: list[int]


class ClaimResult(msgspec.Struct, frozen=True):
    """What a claim took, and what the shared rate limiter said."""

    claimed: list[ClaimedJob]
    limiter: LimiterState = LimiterState()


class HeartbeatRow(msgspec.Struct, frozen=True):
    id: int
    status: JobStatus | None
    error_code: ErrorCode | None
    alive: bool


class DraftPiece(msgspec.Struct, frozen=True):
    """A running job's text streamed since its draft's last write, to be
    appended after character ``from_char`` (code points)."""

    job_id: int
    from_char: int
    text: str
