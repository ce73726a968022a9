"""Typed records that the query functions in shared/store.py take and return."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal
from typing import Any

import msgspec


class KeyAuth(msgspec.Struct, frozen=True):
    """The authentication part of every api lookup."""

    client_id: int
    key_hash: bytes
    revoked: bool


class IdempotentLookup(msgspec.Struct, frozen=True):
    client_id: int
    key_hash: bytes
    revoked: bool
    public_id: uuid.UUID | None
    status: str | None
    request_fingerprint: bytes | None
    created_at: datetime | None


class Admission(msgspec.Struct, frozen=True):
    """One new job asked of job_insert_if_admitted."""

    client_id: int
    idempotency_key: str
    request_fingerprint: bytes
    request_json: str


class EnqueueResult(msgspec.Struct, frozen=True):
    ord: int
    # inserted | existing | queue_full | client_queue_full
    outcome: str
    public_id: uuid.UUID | None
    status: str | None
    request_fingerprint: bytes | None
    created_at: datetime | None
    notified: int


class JobView(msgspec.Struct, frozen=True):
    """GET /stories/jobs/{id}: the key's client and, if it is theirs, the job."""

    client_id: int
    key_hash: bytes
    revoked: bool
    public_id: uuid.UUID | None
    status: str | None
    error_code: str | None
    error_text: str | None
    progress: int | None
    created_at: datetime | None
    started_at: datetime | None
    completed_at: datetime | None
    queue_position: int | None
    story_id: uuid.UUID | None
    story_title: str | None
    story_body: str | None
    story_model: str | None
    story_input_tokens: int | None
    story_output_tokens: int | None
    story_cost_usd: Decimal | None


class CancelResult(msgspec.Struct, frozen=True):
    previous_status: str
    cancelled: bool


class StoryView(msgspec.Struct, frozen=True):
    client_id: int
    key_hash: bytes
    revoked: bool
    story_id: uuid.UUID | None
    title: str | None
    body: str | None
    model: str | None
    prompt_version: str | None
    input_tokens: int | None
    output_tokens: int | None
    cost_usd: Decimal | None
    created_at: datetime | None
    job_id: uuid.UUID | None


class DrainStats(msgspec.Struct, frozen=True):
    pending: int
    running: int
    avg_run_seconds: float | None
    avg_output_tokens: float | None


class ClaimedJob(msgspec.Struct, frozen=True):
    """A job this worker now owns; its claim wrote ledger row (id, attempt 1)."""

    id: int
    public_id: uuid.UUID
    client_id: int
    request: dict[str, Any]
    created_at: datetime
    started_at: datetime


class Completion(msgspec.Struct, frozen=True):
    """A written story, waiting to complete its job."""

    job_id: int
    client_id: int
    attempt: int
    title: str
    body: str
    model: str
    prompt_version: str
    input_tokens: int
    output_tokens: int
    cost_usd: Decimal
    request_id: str | None


class Failure(msgspec.Struct, frozen=True):
    """A job its worker gives up on, with how its last LLM call ended."""

    job_id: int
    attempt: int
    error_code: str
    error_text: str
    call_outcome: str
    billed: bool
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: Decimal = Decimal(0)


class SettleResult(msgspec.Struct, frozen=True):
    completed_ids: list[int]
    already_completed_ids: list[int]
    claimed: list[ClaimedJob]


class HeartbeatRow(msgspec.Struct, frozen=True):
    id: int
    status: str | None
    error_code: str | None
    alive: bool


class StaleJob(msgspec.Struct, frozen=True):
    id: int
    public_id: uuid.UUID
    reason: str
    worker_id: str | None


class QueueGauges(msgspec.Struct, frozen=True):
    pending: int
    running: int
    oldest_pending_age_seconds: float


class KeyListRow(msgspec.Struct, frozen=True):
    key_prefix: str
    client_name: str
    created_at: datetime
    revoked_at: datetime | None


class JobListRow(msgspec.Struct, frozen=True):
    public_id: uuid.UUID
    client_name: str
    status: str
    error_code: str | None
    progress: int
    created_at: datetime
    started_at: datetime | None
    completed_at: datetime | None
    worker_id: str | None


class JobAdminRow(msgspec.Struct, frozen=True):
    id: int
    public_id: uuid.UUID
    client_name: str
    status: str
    error_code: str | None
    error_text: str | None
    progress: int
    worker_id: str | None
    story_id: uuid.UUID | None
    request: dict[str, Any]
    created_at: datetime
    started_at: datetime | None
    heartbeat_at: datetime | None
    completed_at: datetime | None


class LlmCallRow(msgspec.Struct, frozen=True):
    attempt: int
    worker_id: str
    provider: str
    model: str
    started_at: datetime
    finished_at: datetime | None
    outcome: str
    billed: bool
    input_tokens: int
    output_tokens: int
    cost_usd: Decimal
    request_id: str | None
    error_text: str | None


class HourStats(msgspec.Struct, frozen=True):
    pending: int
    running: int
    succeeded_calls: int
    failed_calls: int
    billed_calls: int
    input_tokens: int
    output_tokens: int
    cost_usd: Decimal


# -- operators ---------------------------------------------------------------------


class OperatorKeyAuth(msgspec.Struct, frozen=True):
    """The authentication of every /ops request."""

    key_hash: bytes
    revoked: bool
    name: str


class OperatorKeyListRow(msgspec.Struct, frozen=True):
    key_prefix: str
    name: str
    created_at: datetime
    revoked_at: datetime | None
