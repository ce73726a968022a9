"""The batch lane's metrics (served on the worker's METRICS_PORT with the
others). The alert that uses them is in deploy/prometheus/alerts.yml and
docs/batches.md."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Counter, Gauge

from worker.batch.rows import LiveBatch

IN_FLIGHT = Gauge(
    "storyjobs_batches_in_flight",
    "Message batches the lane looks after, by state: intent (created or not: its create call is unanswered, "
    "reconciled), sent (in flight at the provider), stray (found after a lost create: cancelled, its results "
    "charged), lost (given up, still watched for a day). As the lease holder saw them at its last tick; 0 in a "
    "worker that does not hold the lease.",
    ["state"],
)
STATES = ("intent", "sent", "stray", "lost")
for _state in STATES:
    IN_FLIGHT.labels(state=_state)

BATCHES = Counter(
    "storyjobs_batches_total",
    "Batch events: created (the create answered), adopted (a create whose answer was lost, found by listing), "
    "lost (none found within BATCH_RECONCILE_GRACE_S: its jobs failed as unknown), stray (a batch nobody knew), "
    "read (its results all ingested).",
    ["event"],
)
for _event in ("created", "adopted", "lost", "stray", "read"):
    BATCHES.labels(event=_event)

REQUESTS = Counter(
    "storyjobs_batch_requests_total",
    "Batch requests by result: succeeded (billed), errored, expired, canceled (none billed), unknown (its result "
    "could not be read: charged its worst case).",
    ["result"],
)
for _result in ("succeeded", "errored", "expired", "canceled", "unknown"):
    REQUESTS.labels(result=_result)

COST = Counter("storyjobs_batch_cost_usd_total", "What the batch lane's requests cost, at the batch price.")
SAVED = Counter(
    "storyjobs_batch_saved_usd_total",
    "What the batch lane's billed requests would have cost more on the interactive lane (its price minus the batch "
    "price).",
)


def set_in_flight(live: Sequence[LiveBatch]) -> None:
    for state in STATES:
        IN_FLIGHT.labels(state=state).set(sum(batch.state == state for batch in live))
