"""The api's Prometheus metrics (served on /metrics). Alerts that use them
are listed in README.md, Operations."""

from __future__ import annotations

import functools

from prometheus_client import Counter, Histogram

JOBS_ACCEPTED = Counter("storyjobs_jobs_accepted_total", "Jobs stored by POST /stories/generate.")
JOBS_REPLAYED = Counter(
    "storyjobs_jobs_replayed_total", "POSTs answered with an existing job (same Idempotency-Key)."
)
JOBS_REJECTED = Counter(
    "storyjobs_jobs_rejected_total", "POSTs that stored nothing, by reason.", ["reason"]
)
REJECT_REASONS = (
    "unauthorized",
    "invalid_request",
    "body_too_large",
    "idempotency_mismatch",
    "queue_full",
    "client_queue_full",
    "batch_queue_full",
    "client_batch_queue_full",
    "budget_exhausted",
    "client_budget_exhausted",
    "database_unavailable",
)
for _reason in REJECT_REASONS:
    JOBS_REJECTED.labels(reason=_reason)

HTTP_REQUESTS = Counter(
    "storyjobs_http_requests_total", "HTTP requests answered, by route and status.", ["method", "route", "status"]
)
HTTP_DURATION = Histogram(
    "storyjobs_http_request_duration_seconds",
    "Time to answer an HTTP request, by route.",
    ["method", "route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)


@functools.lru_cache(maxsize=1024)
def http_series(method: str, route: str, status: str) -> tuple[Counter, Histogram]:
    """The request counter and duration histogram of one method, route and
    status, looked up once rather than on every request (labels() takes a
    lock and builds its key each time); bounded, as a client chooses the method."""
    return HTTP_REQUESTS.labels(method=method, route=route, status=status), HTTP_DURATION.labels(method=method, route=route)
