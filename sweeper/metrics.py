"""The sweeper's Prometheus metrics (served on METRICS_PORT). Alerts that use
them are listed in README.md, Operations."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from shared.status import ErrorCode, JobStatus

RECLAIMED = Counter(
    "storyjobs_sweeper_reclaimed_total", "Jobs the sweeper failed, by reason.", ["reason"]
)
REASONS = (ErrorCode.INTERRUPTED, ErrorCode.TIMED_OUT, ErrorCode.QUEUE_TIMEOUT)
for _reason in REASONS:
    RECLAIMED.labels(reason=_reason.value)

PRUNED = Counter("storyjobs_sweeper_pruned_total", "Finished jobs deleted past JOB_RETENTION_S.")
LEDGER_PRUNED = Counter("storyjobs_sweeper_ledger_pruned_total",
                        "Ledger rows of interactive calls deleted past LEDGER_RETENTION_S, their jobs gone.")
STORY_PARTITIONS_DROPPED = Counter(
    "storyjobs_sweeper_story_partitions_dropped_total",
    "Partitions of stories dropped whole once every job of their range was pruned.")
STORY_PARTITIONS_BEHIND = Gauge(
    "storyjobs_story_partitions_behind",
    "1 while stories_ahead holds stories, so that no range of stories can be added (the sweeper was stopped "
    "for longer than the ranges kept ahead); its stories are pruned row by row.")

JOBS = Gauge("storyjobs_jobs", "Live jobs of the interactive lane by status, read from the database at each pass "
             "(the batch lane's are on storyjobs_batches_in_flight).", ["status"])
for _status in (JobStatus.PENDING, JobStatus.RUNNING):
    JOBS.labels(status=_status)

OLDEST_PENDING_AGE = Gauge(
    "storyjobs_oldest_pending_age_seconds",
    "Age of the oldest pending job of the interactive lane at the last pass (0 when none)."
)
LAST_RUN = Gauge(
    "storyjobs_sweeper_last_run_timestamp_seconds", "Unix time the last sweeper pass finished."
)
HEARTBEAT_CHECKS = Gauge(
    "storyjobs_sweeper_heartbeat_checks_enabled",
    "1 when the sweeper reclaims by heartbeat; 0 while it waits out a heartbeat timeout after "
    "(re)connecting, so an outage is not taken for dead workers.",
)

# today's (UTC) spend budgets, all clients (scope "all") and each client that
# spent or reserved today; only kept while a budget reserves anything
BUDGET_SPENT = Gauge(
    "storyjobs_budget_spent_usd", "What the jobs accepted today (UTC) have cost so far, by scope.", ["scope"]
)
BUDGET_RESERVED = Gauge(
    "storyjobs_budget_reserved_usd",
    "The worst cases that today's (UTC) unfinished jobs hold against their budgets, by scope.",
    ["scope"],
)
for _gauge in (BUDGET_SPENT, BUDGET_RESERVED):
    _gauge.labels(scope="all")

# the webhook outbox, read at each pass
WEBHOOK_UNDELIVERED = Gauge(
    "storyjobs_webhook_undelivered", "Webhook deliveries not yet delivered (waiting or in flight) at the last pass."
)
WEBHOOK_OLDEST_UNDELIVERED_AGE = Gauge(
    "storyjobs_webhook_oldest_undelivered_age_seconds",
    "Age of the oldest webhook event not yet delivered, at the last pass (0 when none).",
)

# what holds VACUUM back (database_snapshot_ages); NaN while the sweeper's
# role cannot read other roles' sessions (grant it pg_monitor)
SNAPSHOT_AGES_KNOWN = Gauge(
    "storyjobs_database_snapshot_ages_known",
    "1 when the sweeper's role can see every session's transaction (pg_monitor); 0: the ages below are NaN.",
)
OLDEST_TRANSACTION_AGE = Gauge(
    "storyjobs_database_oldest_transaction_age_seconds",
    "Age of the oldest open transaction on the jobs' database (prepared ones included) at the last pass "
    "(0 when none, NaN when unknown).",
)
OLDEST_SNAPSHOT_AGE = Gauge(
    "storyjobs_database_oldest_snapshot_age_seconds",
    "Age of the oldest snapshot a session holds on the jobs' database (its backend_xmin), at the last pass: "
    "VACUUM removes no row changed after it (0 when none, NaN when unknown).",
)
REPLICATION_SLOT_XMIN_AGE = Gauge(
    "storyjobs_database_replication_slot_xmin_age_transactions",
    "The oldest xmin a replication slot keeps, in transactions behind the current one (0 when none).",
)


class DatabaseTotal(Collector):
    """A counter whose total the database keeps: exported at the value the
    last pass read, and not before the first pass, so that a restarted
    sweeper continues the series instead of resetting it to 0."""

    def __init__(self, name: str, documentation: str) -> None:
        self.name = name
        self.documentation = documentation
        self.value: float | None = None

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation)
        if self.value is not None:
            family.add_metric([], self.value)
        yield family


# alert: BudgetChargesOverReservation (deploy/prometheus/alerts.yml)
OVER_RESERVATION = DatabaseTotal(
    "storyjobs_budget_over_reservation_usd",
    "What jobs' charges passed their reservations by (the provider reported more usage than admission "
    "bounded), all clients, every day.",
)
REGISTRY.register(OVER_RESERVATION)
