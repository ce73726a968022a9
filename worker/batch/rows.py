"""The batch lane's records: what its store's statements take and answer
(worker/batch/store.py)."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

import msgspec


class LeaseTaken(msgspec.Struct, frozen=True):
    """The submitter's lease is ours under ``token`` for ``lease_s``."""

    token: int
    lease_s: float


class Lease(msgspec.Struct, frozen=True):
    """The lease a holder's statements are fenced by: each changes nothing
    unless the lease is still ``holder``'s under ``token``."""

    holder: str
    token: int


class ReadySummary(msgspec.Struct, frozen=True):
    """Batch jobs waiting for a batch (counted up to BATCH_MAX_REQUESTS), and
    how long the oldest has waited."""

    ready: int
    oldest_s: float


class IntentItem(msgspec.Struct, frozen=True):
    custom_id: str
    job_id: int
    attempt: int
    request: dict[str, Any]
    max_tokens: int | None = None
    model: str | None = None
    trace_context: Any = None


class Intent(msgspec.Struct, frozen=True):
    """A batch's intent, committed: its jobs are running under it, each with
    its item and its ledger row."""

    id: int
    fence_at: datetime
    items: list[IntentItem]


class LiveBatch(msgspec.Struct, frozen=True):
    id: int
    state: str
    provider_batch_id: str | None
    model: str
    request_count: int
    fence_at: datetime
    expires_at: datetime | None
    processing_status: str | None
    cancel_asked_at: datetime | None
    lost_batch_id: int | None
    age_s: float
    # every job of it was ended elsewhere (cancelled, swept)
    abandoned: bool


class BatchItemRow(msgspec.Struct, frozen=True):
    """One request of a batch, with what its job was admitted with."""

    custom_id: str
    job_id: int
    attempt: int
    request: dict[str, Any]
    max_tokens: int | None
    model: str | None
    input_usd_per_mtok: Decimal | None
    output_usd_per_mtok: Decimal | None
    trace_context: Any = None


class RefusedAnswer(msgspec.Struct, frozen=True):
    refused: int
    failed: int
    waiting: int


class SentAnswer(msgspec.Struct, frozen=True):
    """Whether the intent was adopted as the provider's batch; if a row of
    ours already records that batch, which (and its state); whether the
    lease was still ours."""

    sent: bool
    known_as: int | None
    known_state: str | None
    lease_held: bool


class LostAnswer(msgspec.Struct, frozen=True):
    lost: int
    failed: int


class IngestAnswer(msgspec.Struct, frozen=True):
    """What one chunk of results did."""

    read: int
    completed: int
    billed_unseen: int
    failed: int
    waiting: int
    cost_usd: Decimal


class ResultRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One result as batch_results_ingest takes it: the tokens already the
    ones the ledger charges (the reported usage, or the worst case)."""

    custom_id: str
    result: str  # succeeded | errored | expired | canceled
    rejected: bool = False
    story_id: str | None = None
    title: str | None = None
    body: str | None = None
    model: str | None = None
    prompt_version: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    request_id: str | None = None
    error_text: str | None = None
