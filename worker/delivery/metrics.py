"""The worker's webhook metrics (served on METRICS_PORT with the others).
The alert that uses them is in deploy/prometheus/alerts.yml and
docs/webhooks.md."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

DELIVERIES = Counter(
    "storyjobs_webhook_deliveries_total",
    "Webhook delivery attempts by outcome: delivered (2xx), retried (failed, due again later), "
    "dead (failed with no retry left), gone (410: the endpoint is disabled), lost (the attempt was "
    "no longer the delivery's when it ended).",
    ["outcome"],
)
OUTCOMES = ("delivered", "retried", "dead", "gone", "lost")
for _outcome in OUTCOMES:
    DELIVERIES.labels(outcome=_outcome)

REFUSED = Counter(
    "storyjobs_webhook_refused_total",
    "Webhook attempts not sent because the URL or an address it resolved to is not allowed "
    "(not https, or not public while WEBHOOK_ALLOW_PRIVATE is false).",
)

ATTEMPT_ERRORS = Counter(
    "storyjobs_webhook_attempt_errors_total",
    "Webhook attempts that raised what no rule foresaw (recorded as failed attempts, retried on the schedule); "
    "each one is a defect to look at in the log event webhook.attempt_raised.",
)

ATTEMPT_DURATION = Histogram(
    "storyjobs_webhook_attempt_duration_seconds",
    "One delivery attempt, from resolving the host to the receiver's answer (or the timeout).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15),
)
LATENCY = Histogram(
    "storyjobs_webhook_delivery_latency_seconds",
    "From the job's end (the event) to its delivery, retries included, by the database's clock.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 7200, 36000, 172800),
)
