"""The console's rows (shared/console_store.py): what operators read and do,
from the console (api/ops/) and the ``storyjobs`` command alike. The rows
the sweeper or the api read too are in shared/rows.py."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal
from typing import Any, Literal

import msgspec

from shared.rows import WebhookEndpointRow
from shared.status import Lane, LlmOutcome


class OperatorKeyAuth(msgspec.Struct, frozen=True):
    """The authentication of every /ops request."""

    key_hash: bytes
    revoked: bool
    name: str
    # operator_actions.operator_key_id of what this key does
    key_id: int = 0


class OperatorKeyListRow(msgspec.Struct, frozen=True):
    key_prefix: str
    name: str
    created_at: datetime
    revoked_at: datetime | None


OperatorAction = Literal["job_cancel", "pending_cancel", "client_keys_revoke", "key_revoke", "client_weight_set",
                         "retry_delivery"]


class OperatorActionRow(msgspec.Struct, frozen=True):
    """One recorded operator action; filter is its JSON text, as stored."""

    id: int
    operator: str
    operator_key_prefix: str
    action: OperatorAction
    job_id: uuid.UUID | None
    filter: str | None
    touched: int
    acted_at: datetime


class JobFilter(msgspec.Struct, frozen=True, kw_only=True):
    """The console's filters; None leaves a field unfiltered."""

    status: str | None = None
    client_id: int | None = None
    error_code: str | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None


class OpsJobRow(msgspec.Struct, frozen=True):
    """A row of the console's jobs list, with what its ledger billed."""

    id: int
    public_id: uuid.UUID
    client_id: int
    client_name: str
    status: str
    lane: Lane
    error_code: str | None
    worker_id: str | None
    progress: int
    created_at: datetime
    started_at: datetime | None
    completed_at: datetime | None
    calls: int
    billed_calls: int
    cost_usd: Decimal


class OpsJobDetail(msgspec.Struct, frozen=True):
    """A job's page: the job, its client and its story, if one was written."""

    id: int
    public_id: uuid.UUID
    client_id: int
    client_name: str
    status: str
    lane: Lane
    error_code: str | None
    error_text: str | None
    worker_id: str | None
    progress: int
    request: dict[str, Any]
    created_at: datetime
    started_at: datetime | None
    heartbeat_at: datetime | None
    completed_at: datetime | None
    story_id: uuid.UUID | None
    story_title: str | None
    story_body: str | None
    story_model: str | None
    story_prompt_version: str | None
    story_input_tokens: int | None
    story_output_tokens: int | None
    story_cost_usd: Decimal | None
    # a batch job: since when it waits for a batch (null: it is in one, or ended)
    # a running job's draft: its text so far, length (code points), last growth
    draft_text: str | None = None
    draft_chars: int | None = None
    draft_updated_at: datetime | None = None
    batch_ready_at: datetime | None = None
    # a batch job's batch: the one that owns it, or its last while it waits for the next
    batch_id: int | None = None
    batch_state: str | None = None
    batch_provider_id: str | None = None
    batch_processing_status: str | None = None
    batch_expires_at: datetime | None = None


class OpsBatchRow(msgspec.Struct, frozen=True):
    """A message batch as the console's batches screen and ``storyjobs
    batches`` show it, with what its ledger rows cost."""

    id: int
    state: str
    provider_batch_id: str | None
    model: str
    request_count: int
    holder: str | None
    created_at: datetime
    sent_at: datetime | None
    expires_at: datetime | None
    ended_at: datetime | None
    results_read_at: datetime | None
    processing_status: str | None
    # what the provider last said: processing, succeeded, errored, canceled, expired
    request_counts: dict[str, int] | None
    cancel_asked_at: datetime | None
    lost_batch_id: int | None
    age_s: float
    billed_requests: int
    cost_usd: Decimal


class LlmCallRow(msgspec.Struct, frozen=True):
    attempt: int
    worker_id: str
    provider: str
    model: str
    started_at: datetime
    finished_at: datetime | None
    outcome: LlmOutcome
    billed: bool
    input_tokens: int
    output_tokens: int
    cost_usd: Decimal
    request_id: str | None
    error_text: str | None


class PendingCount(msgspec.Struct, frozen=True):
    """The pending jobs a filter matches, and the highest id among them."""

    pending: int
    through_id: int | None


class OpsClientKey(msgspec.Struct, frozen=True):
    key_prefix: str
    created_at: datetime
    revoked_at: datetime | None


class OpsClient(msgspec.Struct, frozen=True):
    client_id: int
    name: str
    created_at: datetime
    keys: list[OpsClientKey]
    budget_usd_per_day: Decimal | None = None
    weight: int = 1


class ClientToday(msgspec.Struct, frozen=True):
    client_id: int
    jobs: int
    failed: int


class OpsOverviewRow(msgspec.Struct, frozen=True):
    # the interactive lane's queue
    pending: int
    running: int
    oldest_pending_age_s: float
    # the batch lane's live jobs: waiting for a batch, or in one
    batch_live: int
    hour_completed: int
    hour_failed: int
    hour_cancelled: int
    day_completed: int
    day_failed: int
    day_cancelled: int
    hour_undelivered: int
    hour_undelivered_usd: Decimal
    day_undelivered: int
    day_undelivered_usd: Decimal
    hour_billed_calls: int
    hour_spend_usd: Decimal
    hour_input_tokens: int
    hour_output_tokens: int
    hour_rate_limited: int
    hour_overloaded: int
    day_billed_calls: int
    day_spend_usd: Decimal
    day_input_tokens: int
    day_output_tokens: int
    day_rate_limited: int
    day_overloaded: int


class RateBucketRow(msgspec.Struct, frozen=True):
    model: str
    requests: float | None
    input_tokens: float | None
    output_tokens: float | None
    paused_s: float


class RollupMinuteRow(msgspec.Struct, frozen=True):
    """One minute of the console's history (minute_rollup)."""

    minute: datetime
    completed: int
    failed: int
    cancelled: int
    spend_usd: Decimal
    rate_limited: int
    pending_max: int
    running_max: int
    # counts per bucket of ROLLUP_BOUNDS_S
    wait_counts: list[int]
    run_counts: list[int]


class WorkerRow(msgspec.Struct, frozen=True):
    """A worker seen in the last hour: by the running jobs it holds, or by its last request."""

    worker_id: str
    running: int
    last_heartbeat_at: datetime | None
    heartbeat_age_s: float | None
    last_request_at: datetime | None
    job_ids: list[uuid.UUID]


class WebhookEndpointAdminRow(WebhookEndpointRow, frozen=True):
    """An endpoint with its client and its deliveries by state (CLI, console)."""

    client_id: int
    client_name: str
    pending: int
    dead: int


class WebhookDeliveryRow(msgspec.Struct, frozen=True):
    """A delivery and its last attempt (CLI, console)."""

    id: int
    endpoint_id: uuid.UUID
    url: str
    job_id: uuid.UUID
    job_status: str
    error_code: str | None
    state: str
    attempts: int
    created_at: datetime
    next_attempt_at: datetime
    last_attempt_at: datetime | None
    last_status_code: int | None
    last_error: str | None
    delivered_at: datetime | None
