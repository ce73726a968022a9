"""Bodies of the operators' console endpoints (api/ops/).

Money is a decimal string in US dollars, as in the client's api. The overview
is grouped by subject, each with its last hour and last day, so that what is
still to come lands in the group it belongs to as new fields: the daily
budgets (BUDGET_USD_PER_DAY, CLIENT_BUDGET_USD_PER_DAY) in ``spend``, and the
provider's limits as the shared rate limiter sees them in ``provider``.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any

import msgspec

from api.schemas import JobDraft, WrittenStory
from shared.console_rows import (
    LlmCallRow,
    OpsClientKey,
    WebhookDeliveryRow,
    WebhookEndpointAdminRow,
)
from shared.status import Lane

Usd = Annotated[str, msgspec.Meta(description="Decimal, in US dollars.")]
_MICRO_USD = Decimal("0.000001")
# ids are Postgres bigints
BIGINT_MAX = 2**63 - 1
Id = Annotated[int, msgspec.Meta(ge=1, le=BIGINT_MAX)]
# what api/ops/cursor.py's tokens look like: unpadded base64url
TOKEN_PATTERN = "^[A-Za-z0-9_-]{1,400}$"
Count = Annotated[int, msgspec.Meta(ge=0)]


def usd(value: Decimal | None) -> str:
    """An amount as the ledger keeps it: six decimals."""
    return str((value if value is not None else Decimal(0)).quantize(_MICRO_USD))


# -- overview ------------------------------------------------------------------------


class Queue(msgspec.Struct, frozen=True):
    """The live jobs, now: the interactive lane's queue, and the batch lane's jobs apart."""

    pending: Annotated[int, msgspec.Meta(ge=0, description="Interactive jobs waiting for a worker.")]
    running: Annotated[int, msgspec.Meta(ge=0, description="Interactive jobs a worker is writing.")]
    oldest_pending_age_s: Annotated[float, msgspec.Meta(ge=0, description="0 when nothing is pending.")]
    queue_max: Annotated[int, msgspec.Meta(description="QUEUE_MAX: the most pending jobs admitted.")]
    batch_live: Annotated[int, msgspec.Meta(
        ge=0, description="Batch lane jobs waiting for a batch or in one (see /ops/api/batches).")] = 0
    batch_queue_max: Annotated[int, msgspec.Meta(
        description="BATCH_QUEUE_MAX: the most live batch jobs admitted.")] = 0


class Snapshots(msgspec.Struct, frozen=True):
    """What holds VACUUM back on the jobs' database, now: while a transaction or a snapshot stays open, no row
    changed after it is removed and the live-jobs indexes fill with dead entries (the claim slows)."""

    known: Annotated[bool, msgspec.Meta(
        description="false: the api's role cannot see other roles' sessions (grant it pg_monitor); the ages "
                    "are then null.")]
    oldest_transaction_age_s: Annotated[float | None, msgspec.Meta(
        description="The oldest open transaction (prepared ones included); null: none, or unknown.")]
    oldest_snapshot_age_s: Annotated[float | None, msgspec.Meta(
        description="The oldest snapshot a session holds (its backend_xmin); null: none, or unknown.")]
    replication_slot_xmin_age: Annotated[int | None, msgspec.Meta(
        description="The oldest xmin a replication slot keeps, in transactions; null: no slot holds one.")]
    warn_after_s: Annotated[float, msgspec.Meta(description="XMIN_HORIZON_WARN_S.")]
    warning: Annotated[str | None, msgspec.Meta(
        description="What to look at, when the oldest transaction or snapshot passed XMIN_HORIZON_WARN_S.")]


class JobCounts(msgspec.Struct, frozen=True):
    """Jobs that finished in the window."""

    completed: Count
    failed: Annotated[int, msgspec.Meta(ge=0, description="Every failed job, cancelled ones included.")]
    cancelled: Count
    failure_ratio: Annotated[float, msgspec.Meta(
        ge=0, le=1, description="Failed but not cancelled, over finished but not cancelled; null: none finished.",
    )] | None


class JobWindows(msgspec.Struct, frozen=True):
    last_hour: JobCounts
    last_day: JobCounts


class SpendCounts(msgspec.Struct, frozen=True):
    """What the provider billed for requests sent in the window (the ledger)."""

    usd: Usd
    billed_calls: Count
    input_tokens: Count
    output_tokens: Count


class BudgetToday(msgspec.Struct, frozen=True):
    """Today (UTC) against BUDGET_USD_PER_DAY: what the jobs accepted today cost so far, and the worst
    cases the unfinished ones hold."""

    spent_usd: Usd
    reserved_usd: Usd
    budget_usd: Annotated[str, msgspec.Meta(description="Decimal, in US dollars; null: no budget.")] | None
    left_usd: Annotated[str, msgspec.Meta(description="What the next jobs may reserve; null: no budget.")] | None


class Spend(msgspec.Struct, frozen=True):
    last_hour: SpendCounts
    last_day: SpendCounts
    today: BudgetToday


class UndeliveredCounts(msgspec.Struct, frozen=True):
    """Jobs that failed in the window after calls that were billed: paid for, never delivered."""

    jobs: Count
    usd: Usd


class Undelivered(msgspec.Struct, frozen=True):
    last_hour: UndeliveredCounts
    last_day: UndeliveredCounts


class ProviderCounts(msgspec.Struct, frozen=True):
    """How often the provider turned requests away in the window (neither is billed)."""

    rate_limited: Annotated[int, msgspec.Meta(ge=0, description="429 answers.")]
    overloaded: Annotated[int, msgspec.Meta(ge=0, description="529 answers.")]


class LimitKind(msgspec.Struct, frozen=True):
    """One kind of the shared rate bucket, refilled to now."""

    available: float
    capacity: float
    per_minute: float


class Limiter(msgspec.Struct, frozen=True):
    """The shared rate bucket of LLM_MODEL: each configured kind (null: no limit of that kind), and how
    long a 429 (or the provider's headers) still holds every claim."""

    model: str
    paused_s: Annotated[float, msgspec.Meta(ge=0)]
    requests: LimitKind | None
    input_tokens: LimitKind | None
    output_tokens: LimitKind | None


class Provider(msgspec.Struct, frozen=True):
    last_hour: ProviderCounts
    last_day: ProviderCounts
    limiter: Limiter


class Overview(msgspec.Struct, frozen=True):
    """The console's first screen."""

    generated_at: datetime
    queue: Queue
    jobs: JobWindows
    spend: Spend
    undelivered: Undelivered
    provider: Provider
    writers: Annotated[list[str], msgspec.Meta(
        description="The writers that sent requests in the last day (the ledger's provider): `offline` is the "
                    "built-in offline writer, whose stories are demo text and cost nothing.")] = []
    snapshots: Snapshots | None = None


class Percentiles(msgspec.Struct, frozen=True):
    """Wait and run time percentiles, each to the upper bound of its rollup bucket; null: no job."""

    wait_p50_s: Annotated[float, msgspec.Meta(description="Of the jobs claimed: time from creation to claim.")] | None
    wait_p95_s: float | None
    run_p50_s: Annotated[float, msgspec.Meta(description="Of the jobs completed: time from claim to end.")] | None
    run_p95_s: float | None


class HistoryBucket(Percentiles, frozen=True):
    """A stretch of the history (bucket_minutes long) from the sweeper's rollup."""

    at: Annotated[datetime, msgspec.Meta(description="Its start.")]
    completed: Count
    failed: Annotated[int, msgspec.Meta(ge=0, description="Cancellations included.")]
    cancelled: Count
    spend_usd: Usd
    rate_limited: Annotated[int, msgspec.Meta(ge=0, description="The provider's 429 answers.")]
    pending_max: Annotated[int, msgspec.Meta(ge=0, description="The most pending jobs a sweeper pass saw.")]
    running_max: Count


class History(msgspec.Struct, frozen=True):
    """The range's buckets, oldest first, the current one last; empty minutes count zero (no sweeper pass
    in a minute leaves it empty too)."""

    range: str
    bucket_minutes: int
    buckets: list[HistoryBucket]
    totals: Percentiles


class Worker(msgspec.Struct, frozen=True):
    worker_id: str
    state: Annotated[str, msgspec.Meta(description=(
        "busy: holds running jobs and heartbeats; gone: holds running jobs whose last heartbeat is older than "
        "HEARTBEAT_TIMEOUT_S; idle: holds none, seen by its last request."))]
    running: Count
    last_heartbeat_at: datetime | None
    heartbeat_age_s: float | None
    last_request_at: datetime | None
    job_ids: list[uuid.UUID]


class Workers(msgspec.Struct, frozen=True):
    """The workers seen in the last hour."""

    heartbeat_timeout_s: float
    workers: list[Worker]


# -- jobs ----------------------------------------------------------------------------


_LANE = msgspec.Meta(description="interactive, or batch: sent in a message batch, within the day at half the price.")


class JobSummary(msgspec.Struct, frozen=True):
    job_id: uuid.UUID
    client_id: int
    client_name: str
    status: str
    lane: Annotated[Lane, _LANE]
    error_code: str | None
    worker_id: str | None
    progress: Annotated[int, msgspec.Meta(description="Output tokens written.")]
    created_at: datetime
    started_at: datetime | None
    completed_at: datetime | None
    calls: Annotated[int, msgspec.Meta(description="Requests sent to the provider (ledger rows).")]
    billed_calls: Count
    cost_usd: Usd


class JobPage(msgspec.Struct, frozen=True):
    """A page of the jobs list, newest first. A page can hold fewer jobs
    than asked (none, even) while older jobs may still match: each request
    looks at a bounded stretch of history. Ask for next_cursor until it is null."""

    jobs: list[JobSummary]
    next_cursor: Annotated[str, msgspec.Meta(description="Opaque: pass as `cursor` for older jobs.")] | None


class Timeline(msgspec.Struct, frozen=True):
    created_at: datetime
    claimed_at: datetime | None
    last_heartbeat_at: datetime | None
    finished_at: datetime | None


class JobErrorDetail(msgspec.Struct, frozen=True):
    code: str
    message: str


class JobStory(WrittenStory, frozen=True):
    cost_usd: Usd
    delivered: Annotated[bool, msgspec.Meta(
        description="False when the job failed after the story was written (and paid for).")]


class JobBatch(msgspec.Struct, frozen=True):
    """The message batch of a batch job: the one that owns it, or its last one while it waits for the next
    (see /ops/api/batches)."""

    id: Id
    state: str
    provider_batch_id: Annotated[str, msgspec.Meta(description="The provider's id; null for an intent.")] | None
    processing_status: Annotated[str, msgspec.Meta(
        description="What the provider last said: in_progress, canceling or ended.")] | None
    expires_at: datetime | None


class JobDetail(msgspec.Struct, frozen=True):
    job_id: uuid.UUID
    client_id: int
    client_name: str
    status: str
    lane: Annotated[Lane, _LANE]
    error: JobErrorDetail | None
    worker_id: str | None
    progress: int
    request: dict[str, Any]
    timeline: Timeline
    # every request sent to the provider for the job, as the ledger holds it
    calls: list[LlmCallRow]
    billed_calls: Count
    cost_usd: Annotated[str, msgspec.Meta(description="What its billed calls cost, in US dollars.")]
    story: JobStory | None
    batch: JobBatch | None = None
    waiting_for_batch_since: Annotated[datetime, msgspec.Meta(
        description="A batch job waiting to be put into a batch: since when (admitted, or its last attempt "
                    "billed nothing).")] | None = None
    due_by: Annotated[datetime, msgspec.Meta(
        description="A live batch job: when it is due at the latest, as its client is told.")] | None = None
    draft: Annotated[JobDraft, msgspec.Meta(
        description="A running job: the story as it is written so far, as its client's poll shows it.")] | None = None


# -- the batch lane ------------------------------------------------------------------


class BatchRequestCounts(msgspec.Struct, frozen=True):
    """The batch's requests as the provider last counted them: processing until the whole batch ends, then
    the other four, which add up to its size."""

    processing: Count = 0
    succeeded: Count = 0
    errored: Count = 0
    canceled: Count = 0
    expired: Count = 0


class OpsBatch(msgspec.Struct, frozen=True):
    """One message batch and what it cost."""

    id: Id
    state: Annotated[str, msgspec.Meta(description=(
        "intent (committed before its create call, not yet answered: reconciled by listing), sent (in flight at "
        "the provider), ended (its results all read), refused (the create was refused: nothing billed), lost (no "
        "batch of it found in time: its jobs failed as calls of unknown outcome), stray (a batch nobody knew, "
        "found after a lost one: cancelled, its results charged)."))]
    provider_batch_id: str | None
    model: str
    request_count: Annotated[int, msgspec.Meta(ge=0, description="Requests in it.")]
    counts: Annotated[BatchRequestCounts, msgspec.Meta(
        description="What the provider last said; null before it was seen there.")] | None
    processing_status: str | None
    created_at: Annotated[datetime, msgspec.Meta(description="When its intent was committed (for a stray: "
                                                             "when it was found).")]
    age_s: Annotated[float, msgspec.Meta(ge=0)]
    sent_at: datetime | None
    expires_at: Annotated[datetime, msgspec.Meta(
        description="When the provider ends it at the latest (its unfinished requests then expire).")] | None
    ended_at: datetime | None
    results_read_at: datetime | None
    cancel_asked_at: datetime | None
    lost_batch_id: Annotated[int, msgspec.Meta(description="A stray: the lost batch it may be.")] | None
    holder: Annotated[str, msgspec.Meta(description="The worker that held the submitter lease and made it.")] | None
    billed_requests: Annotated[int, msgspec.Meta(ge=0, description="Its ledger rows closed as billed.")]
    cost_usd: Annotated[str, msgspec.Meta(description="What its ledger rows cost, at the batch price, in US dollars.")]
    saved_usd: Annotated[str, msgspec.Meta(description=(
        "What the same requests would have cost more at the interactive price: cost × (1 / BATCH_PRICE_FACTOR − 1)."
    ))]


class BatchPage(msgspec.Struct, frozen=True):
    """A page of message batches, newest first."""

    batches: list[OpsBatch]
    next_cursor: Annotated[str, msgspec.Meta(description="Opaque: pass as `cursor` for older batches.")] | None
    price_factor: Annotated[str, msgspec.Meta(
        description="BATCH_PRICE_FACTOR: a batch's request costs this share of the interactive price.")]


# -- actions -------------------------------------------------------------------------


class JobCancelled(msgspec.Struct, frozen=True):
    job_id: uuid.UUID
    previous_status: str
    status: str


class PendingMatch(msgspec.Struct, frozen=True):
    """What a cancel of the pending jobs matching the filter would cancel."""

    pending: Count
    through: Annotated[str, msgspec.Meta(
        description="Opaque: send it back to cancel these jobs and none that arrived since; null when none match.",
    )] | None


class CancelPending(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Cancel the pending jobs a filter matched when they were counted."""

    through: Annotated[str, msgspec.Meta(pattern=TOKEN_PATTERN, description="`through` of GET /ops/api/cancel-pending.")]
    client_id: Id | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None


class PendingCancelled(msgspec.Struct, frozen=True):
    cancelled: Count
    job_ids: list[uuid.UUID]


class ClientDay(msgspec.Struct, frozen=True):
    """A client's day (UTC): its spend against its budget, its jobs created today and their failures."""

    spent_usd: Usd
    reserved_usd: Usd
    budget_usd: Annotated[str, msgspec.Meta(
        description="Its own budget, else CLIENT_BUDGET_USD_PER_DAY; null: none.")] | None
    jobs: Count
    failed: Annotated[int, msgspec.Meta(ge=0, description="Cancellations aside.")]


class Client(msgspec.Struct, frozen=True):
    client_id: int
    name: str
    created_at: datetime
    keys: list[OpsClientKey]
    today: ClientDay | None = None
    weight: Annotated[int, msgspec.Meta(
        description="The client's share of the workers: its jobs are claimed `weight` to a weight-1 client's one "
                    "while both have jobs pending.")] = 1


class Clients(msgspec.Struct, frozen=True):
    clients: list[Client]


class ClientWeight(msgspec.Struct, frozen=True):
    weight: Annotated[int, msgspec.Meta(ge=1, le=1000, description=(
        "The client's share of the workers, 1 to 1,000: its jobs are claimed `weight` to a weight-1 client's one "
        "while both have jobs pending; jobs it sends from now on take it."))]


class KeysRevoked(msgspec.Struct, frozen=True):
    revoked: Annotated[list[str], msgspec.Meta(description="Prefixes of the keys revoked now.")]


# -- the audit trail -----------------------------------------------------------------


class OperatorActionView(msgspec.Struct, frozen=True):
    """One operator action, as recorded in its own transaction."""

    id: Id
    operator: Annotated[str, msgspec.Meta(description="The name of the operator key that acted.")]
    operator_key_prefix: str
    action: Annotated[str, msgspec.Meta(
        description="job_cancel, pending_cancel, client_keys_revoke, key_revoke, client_weight_set or "
                    "retry_delivery.")]
    job_id: Annotated[uuid.UUID | None, msgspec.Meta(description="The job of a job_cancel or a retry_delivery.")]
    filter: Annotated[dict[str, Any] | None, msgspec.Meta(
        description="What the other actions matched: client_id, created_after, created_before and through of a "
                    "pending_cancel; client_id or key_prefix of a revocation; client_id and weight of a "
                    "client_weight_set; delivery_id of a retry_delivery.")]
    touched: Annotated[int, msgspec.Meta(ge=0, description="How many jobs or keys it changed.")]
    acted_at: datetime


class OperatorActions(msgspec.Struct, frozen=True):
    actions: list[OperatorActionView]


# -- webhooks ------------------------------------------------------------------------


class OpsDelivery(WebhookDeliveryRow, frozen=True):
    """A delivery: pending (waiting or in flight), delivered or dead."""


class OpsEndpoint(WebhookEndpointAdminRow, frozen=True):
    """An endpoint, its deliveries by state, and its last deliveries."""

    last_deliveries: list[OpsDelivery]


class OpsEndpoints(msgspec.Struct, frozen=True):
    endpoints: list[OpsEndpoint]


class DeliveryRetried(msgspec.Struct, frozen=True):
    id: int
    state: str
