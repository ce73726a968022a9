"""The api's rows (api/store.py): what admission, a client's reads of its
jobs and stories, and the pacing hint take and return. The rows the console
or the worker read too are in shared/rows.py."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal
from typing import Literal

import msgspec

from shared.rows import KeyAuth
from shared.status import ErrorCode, JobStatus, Lane


class IdempotentLookup(KeyAuth, frozen=True):
    public_id: uuid.UUID | None
    status: JobStatus | None
    request_fingerprint: bytes | None
    created_at: datetime | None


class Admission(msgspec.Struct, frozen=True):
    """One new job asked of job_insert_if_admitted, with what its call may
    cost: its max_tokens, a likely count of its input tokens (for the rate
    limiter), and its worst case in USD (for the spend budgets)."""

    client_id: int
    idempotency_key: str
    request_fingerprint: bytes
    request_json: str
    max_tokens: int
    input_tokens_estimate: int
    worst_case_usd: Decimal
    # what the worst case assumed, which the job is then run with
    model: str
    input_usd_per_mtok: Decimal
    output_usd_per_mtok: Decimal
    lane: Lane = Lane.INTERACTIVE
    # the W3C trace context of the span that admitted it (empty: none)
    trace_context: dict[str, str] = {}


class EnqueueResult(msgspec.Struct, frozen=True):
    ord: int
    outcome: Literal["inserted", "existing", "queue_full", "client_queue_full", "budget_exhausted",
                     "client_budget_exhausted", "batch_queue_full", "client_batch_queue_full"]
    public_id: uuid.UUID | None
    status: JobStatus | None
    request_fingerprint: bytes | None
    created_at: datetime | None
    notified: int
    # until the budgets' UTC day ends, by the database's clock
    day_ends_in_s: float = 86_400.0


class StoryRow(msgspec.Struct, frozen=True):
    """A written story as clients read it (job_get_for_key, story_get_for_key)."""

    story_id: uuid.UUID
    job_id: uuid.UUID
    title: str
    body: str
    model: str
    prompt_version: str
    input_tokens: int
    output_tokens: int
    cost_usd: Decimal
    created_at: datetime


class DraftRead(msgspec.Struct, frozen=True):
    """A running job's draft as the poll reads it: its length in code points,
    when it last grew (None: nothing written yet), and its text after the
    character the client asked from."""

    chars: int
    updated_at: datetime | None
    text: str


class JobRead(msgspec.Struct, frozen=True):
    """A job as its client reads it (job_get_for_key)."""

    public_id: uuid.UUID
    status: JobStatus
    error_code: ErrorCode | None
    error_text: str | None
    progress: int | None
    created_at: datetime
    started_at: datetime | None
    completed_at: datetime | None
    queue_position: int | None
    story: StoryRow | None
    max_tokens: int | None
    # the database's clock when it answered
    now: datetime
    lane: Lane = Lane.INTERACTIVE
    # a batch job: since when it waits for a batch, and its batch's expiry once sent
    batch_ready_at: datetime | None = None
    batch_expires_at: datetime | None = None
    # running: the text written so far (after the character asked from)
    draft: DraftRead | None = None


class JobView(KeyAuth, frozen=True):
    """GET /stories/jobs/{id}: the key's client and, if it is theirs, the job
    (sent as JSON: see job_get_for_key)."""

    job: JobRead | None


class StoryView(KeyAuth, frozen=True):
    """GET /stories/{id}: the key's client and, if it is theirs, the story."""

    story: StoryRow | None


class DrainStats(msgspec.Struct, frozen=True):
    pending: int
    running: int
    avg_run_seconds: float | None
    avg_output_tokens: float | None
    # how long the shared rate limiter holds every claim (a 429's pause)
    limiter_paused_s: float = 0.0
    # jobs claimed in the last minute (among the newest), and the age of the
    # oldest running job: how soon the queue takes its next job
    claimed_last_minute: int = 0
    longest_running_s: float = 0.0
