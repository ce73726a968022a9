"""Configuration: every setting, declared once as a field of a frozen
msgspec Struct per process (its type, bounds and default), with the checks
between settings, parsed once in ``main()`` (shared/config_load.py reads
the environment) and passed down explicitly. Declarations, mostly: the
reading and the exit on a bad value are in shared/config_load.py.

A bad value stops the process at start with one line naming the variable
(``load_or_exit``). All durations are seconds, so tests can use small ones.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Literal

import msgspec

from shared import webhooks
from shared.pricing import Price
from shared.rows import ROLLUP_KEPT_S

Seconds = Annotated[float, msgspec.Meta(gt=0, le=7 * 24 * 3600)]
# how long history is kept: operators keep a year or several (for disputes,
# accounting), so the bound is a century rather than Seconds' week; Postgres
# subtracts that from now() with room to spare
RETENTION_MAX_S = 100 * 365.25 * 24 * 3600
RetentionSeconds = Annotated[float, msgspec.Meta(gt=0, le=RETENTION_MAX_S)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PerMinute = Annotated[int, msgspec.Meta(ge=1, le=1_000_000_000)]
# what DATABASE_URL reaches: the database ("none") or a transaction pooler
Pooler = Literal["none", "transaction"]

DEFAULT_MODEL = "claude-sonnet-5-5"

# USD per million tokens, (input, output), as Anthropic publishes them.
# Prices change: LLM_PRICES (JSON of the same shape) adds to or overrides this.
DEFAULT_PRICES_USD_PER_MTOK: dict[str, tuple[float, float]] = {
    "claude-sonnet-5-5": (2.0, 10.0),
    "claude-sonnet-5": (2.0, 10.0),
    "claude-opus-5": (5.0, 25.0),
    "claude-haiku-4-5": (1.0, 5.0),
}


WEBHOOK_TIMEOUT_MAX_S = 60.0
# a delivery's lease: its attempt's timeout and this, to record the answer
WEBHOOK_LEASE_MARGIN_S = 5.0
# the longest a webhook event can stay undelivered, whatever the worker's
# settings (the sweeper does not read them): every wait of the retry schedule
# and the longest lease of each attempt
WEBHOOK_LONGEST_UNDELIVERED_S = (sum(webhooks.RETRY_SCHEDULE_S)
                                 + webhooks.MAX_ATTEMPTS * (WEBHOOK_TIMEOUT_MAX_S + WEBHOOK_LEASE_MARGIN_S))


class ConfigError(ValueError):
    """A setting is missing, malformed or contradicts another."""


class BaseSettings(msgspec.Struct, frozen=True, kw_only=True, rename="upper"):
    """What every process reads: the database, logs, and the timeouts that the
    worker and the sweeper must agree on."""

    database_url: str | None = None
    # what DATABASE_URL reaches: the database itself ("none"), or a pooler in
    # transaction mode such as PgBouncer's ("transaction"), in front of which
    # a connection keeps no session state and prepares no statements
    database_pooler: Pooler = "none"
    # a connection that keeps its session, for what needs one: the worker's
    # LISTEN and the migrations' advisory lock; unset: DATABASE_URL. Behind a
    # transaction pooler it must reach the database directly.
    database_listen_url: str | None = None
    log_format: Literal["console", "json"] | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    db_connect_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 5.0
    heartbeat_interval_s: Seconds = 10.0
    heartbeat_timeout_s: Seconds = 60.0
    job_timeout_s: Seconds = 480.0
    pending_timeout_s: Seconds = 1800.0
    # the LLM call: the worker makes it, the api reserves its worst case
    # against the spend budgets and estimates how long a job waits
    llm_model: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] = DEFAULT_MODEL
    llm_max_tokens: Annotated[int, msgspec.Meta(ge=64, le=64_000)] = 4000
    # JSON: {"model": [input_usd_per_mtok, output_usd_per_mtok], ...}
    llm_prices: dict[str, tuple[Annotated[float, msgspec.Meta(ge=0)], Annotated[float, msgspec.Meta(ge=0)]]] = {}
    # the provider account's limits, shared by every worker through Postgres
    # (unset: no configured limit; the provider's headers and 429s still pace)
    llm_requests_per_minute: PerMinute | None = None
    llm_input_tokens_per_minute: PerMinute | None = None
    llm_output_tokens_per_minute: PerMinute | None = None
    # how many seconds of refill the shared bucket holds: the provider enforces
    # a minute's limit over shorter intervals too
    llm_rate_burst_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 5.0
    # webhooks may reach plain http and private, loopback and link-local
    # addresses: for development and tests only (the api checks endpoints'
    # URLs, the worker every address it connects to)
    webhook_allow_private: bool = False
    # the batch lane (docs/batches.md): its pending jobs are collected for
    # BATCH_COLLECT_S, or until BATCH_MAX_REQUESTS wait, into one message
    # batch; batches in flight are looked at every BATCH_POLL_INTERVAL_S; a
    # create whose answer was lost is looked for BATCH_RECONCILE_GRACE_S; a
    # request that billed nothing is sent again, BATCH_MAX_ATTEMPTS in all
    batch_collect_s: Seconds = 60.0
    batch_max_requests: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 1000
    batch_poll_interval_s: Seconds = 60.0
    batch_reconcile_grace_s: Seconds = 600.0
    batch_max_attempts: Annotated[int, msgspec.Meta(ge=1, le=10)] = 3
    # how often a worker writes the text streamed so far of the jobs it holds
    # (one statement for them all), which the poll shows as the job's draft;
    # the api bounds a running job's Retry-After by two of them. 0: no drafts
    draft_interval_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 1.0

    def price(self) -> Price:
        """LLM_MODEL's price, from the built-in table and LLM_PRICES."""
        table = {**DEFAULT_PRICES_USD_PER_MTOK, **self.llm_prices}
        if self.llm_model not in table:
            raise ConfigError(
                f"LLM_MODEL {self.llm_model!r} has no price: add it to LLM_PRICES as "
                '{"model": [input_usd_per_mtok, output_usd_per_mtok]}'
            )
        input_price, output_price = table[self.llm_model]
        return Price(Decimal(str(input_price)), Decimal(str(output_price)))

    def _check_heartbeats(self) -> None:
        # two missed beats must not be enough to declare a live worker dead
        if self.heartbeat_interval_s * 3 > self.heartbeat_timeout_s:
            raise ConfigError(
                "HEARTBEAT_INTERVAL_S must be at most a third of HEARTBEAT_TIMEOUT_S "
                f"({self.heartbeat_interval_s:g} vs {self.heartbeat_timeout_s:g})"
            )

    def _check_pooler(self) -> None:
        if self.database_pooler == "none":
            return
        if not self.database_url:
            raise ConfigError(
                "DATABASE_POOLER=transaction needs DATABASE_URL, the pooler's address "
                "(without it storyjobs uses the embedded Postgres, which has no pooler)"
            )
        if self.database_listen_url == self.database_url:
            raise ConfigError(
                "DATABASE_LISTEN_URL must reach the database directly, not through the transaction pooler "
                "of DATABASE_URL: LISTEN and session advisory locks need a session of their own"
            )

    def __post_init__(self) -> None:
        self._check_heartbeats()
        self._check_pooler()


class ApiSettings(BaseSettings, frozen=True, kw_only=True, rename="upper"):
    api_host: str = "127.0.0.1"
    api_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 8000
    queue_max: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 8
    client_queue_max: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] | None = None
    # an answer waits at most this long for a database connection, then 503
    api_db_wait_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 3.0
    api_statement_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 5.0
    # the longest an answer waits on the database in all (connection and
    # queries), then 503: a hung network cannot hold a request for long
    api_request_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=120)] = 6.0
    api_pool_size: Annotated[int, msgspec.Meta(ge=1, le=100)] = 10
    # processes serving the api on one port (uvicorn workers); in containers,
    # prefer one per container and more replicas
    api_workers: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    # the API documentation pages under /schema/ (api/docs_pages.py); off
    # unless asked for: `make run` turns them on
    api_docs_pages: bool = False
    # spend per UTC day, all clients together and each client (unset: none);
    # a job's worst case is reserved when it is accepted
    budget_usd_per_day: Decimal | None = None
    client_budget_usd_per_day: Decimal | None = None
    # the batch lane's own queue: live batch jobs (waiting for a batch or in
    # one), of all clients and of each
    batch_queue_max: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 10_000
    client_batch_queue_max: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] | None = None
    # the console (and `storyjobs stats`) warns once a transaction or a
    # snapshot on the jobs' database is older than this: VACUUM removes
    # nothing changed after it, and the live-jobs indexes fill
    xmin_horizon_warn_s: Seconds = 300.0

    @property
    def effective_client_batch_queue_max(self) -> int:
        """CLIENT_BATCH_QUEUE_MAX, by default half of BATCH_QUEUE_MAX, for
        the reason CLIENT_QUEUE_MAX is half of QUEUE_MAX."""
        if self.client_batch_queue_max is None:
            return max(1, self.batch_queue_max // 2)
        return self.client_batch_queue_max

    @property
    def effective_client_queue_max(self) -> int:
        """CLIENT_QUEUE_MAX, by default half of QUEUE_MAX (at least 1): a
        client that re-posts the moment a slot frees can hold at most half
        the queue, so the others are always admitted somewhere, and the
        claim's fair share sees their jobs."""
        return max(1, self.queue_max // 2) if self.client_queue_max is None else self.client_queue_max

    def __post_init__(self) -> None:
        self._check_heartbeats()
        self._check_pooler()
        if self.client_queue_max is not None and self.client_queue_max > self.queue_max:
            raise ConfigError(
                f"CLIENT_QUEUE_MAX ({self.client_queue_max}) must not exceed QUEUE_MAX ({self.queue_max})"
            )
        if self.client_batch_queue_max is not None and self.client_batch_queue_max > self.batch_queue_max:
            raise ConfigError(
                f"CLIENT_BATCH_QUEUE_MAX ({self.client_batch_queue_max}) must not exceed BATCH_QUEUE_MAX "
                f"({self.batch_queue_max})"
            )
        for name, budget in (("BUDGET_USD_PER_DAY", self.budget_usd_per_day),
                             ("CLIENT_BUDGET_USD_PER_DAY", self.client_budget_usd_per_day)):
            if budget is not None and not Decimal(0) < budget <= Decimal(10_000_000):
                raise ConfigError(f"{name} must be more than 0 and at most 10000000 (got {budget})")
        # every admission prices its job's worst case, for the spend budgets
        self.price()
        if self.api_request_timeout_s <= self.api_db_wait_s:
            raise ConfigError(
                f"API_REQUEST_TIMEOUT_S ({self.api_request_timeout_s:g}) must be longer than API_DB_WAIT_S "
                f"({self.api_db_wait_s:g}): a request must outlast its wait for a connection"
            )


class WorkerSettings(BaseSettings, frozen=True, kw_only=True, rename="upper"):
    anthropic_api_key: str | None = None
    anthropic_base_url: str | None = None
    llm_timeout_s: Seconds = 300.0
    # longest silence within a stream before the call is abandoned (not retried)
    llm_read_timeout_s: Seconds = 60.0
    # retries of certainly-unbilled errors (429, 529, refused connection)
    llm_retry_attempts: Annotated[int, msgspec.Meta(ge=1, le=20)] = 6
    llm_retry_deadline_s: Seconds = 120.0
    offline_delay_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 3.0
    worker_concurrency: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 1
    worker_shutdown_grace_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 150.0
    worker_poll_interval_s: Seconds = 5.0
    worker_listen: bool = True
    metrics_port: Port = 9100
    # webhook deliveries in flight at once per worker process
    webhook_concurrency: Annotated[int, msgspec.Meta(ge=1, le=100)] = 4
    # one delivery's whole attempt: resolving, connecting, sending, the answer
    webhook_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=WEBHOOK_TIMEOUT_MAX_S)] = 15.0
    # how often an idle worker looks for due deliveries
    webhook_poll_interval_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 1.0
    # multiplies the retry schedule (5 s ... 10 h) and Retry-After: below 1
    # only for tests, which cannot wait hours
    webhook_retry_scale: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    # the longest a message batch's create call may take (the provider
    # accepts up to 256 MB in one); the batch lane's submitter lease lasts
    # twice this and a margin, so it is also about how long the lease takes
    # to pass to another worker when its holder dies
    batch_create_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 120.0

    @property
    def webhook_lease_s(self) -> float:
        """How long a claimed delivery is held: its attempt's timeout and a
        margin to record the answer. A worker killed meanwhile leaves it due
        again after this."""
        return self.webhook_timeout_s + WEBHOOK_LEASE_MARGIN_S

    @property
    def offline(self) -> bool:
        return not self.anthropic_api_key

    def __post_init__(self) -> None:
        self._check_heartbeats()
        self._check_pooler()
        if self.worker_listen and self.database_pooler == "transaction" and not self.database_listen_url:
            raise ConfigError(
                "DATABASE_LISTEN_URL is needed with DATABASE_POOLER=transaction: the worker's LISTEN needs a "
                "session, which a transaction pooler does not keep; set it to a direct connection to the "
                "database, or set WORKER_LISTEN=false to poll every WORKER_POLL_INTERVAL_S instead"
            )
        if self.llm_timeout_s >= self.job_timeout_s:
            raise ConfigError(
                f"LLM_TIMEOUT_S ({self.llm_timeout_s:g}) must be shorter than JOB_TIMEOUT_S "
                f"({self.job_timeout_s:g}): the sweeper would fail a job whose call is still allowed"
            )
        if not self.offline:
            self.price()


class SweeperSettings(BaseSettings, frozen=True, kw_only=True, rename="upper"):
    sweeper_interval_s: Seconds = 30.0
    sweeper_batch_size: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 500
    # finished jobs (and their stories) are deleted this long after finishing;
    # the llm_calls ledger has a retention of its own
    job_retention_s: RetentionSeconds = 30 * 24 * 3600.0
    # the ledger's rows of interactive calls are deleted this long after
    # their call started, once their job is gone; None: kept
    ledger_retention_s: RetentionSeconds | None = None
    metrics_port: Port = 9101

    def __post_init__(self) -> None:
        super().__post_init__()
        # Refused rather than warned about: the prune keeps a job while one
        # of its deliveries is pending whatever this says, so a shorter
        # retention could only ever be a setting that does not do what it
        # says (and, before the prune waited, it lost undelivered events).
        if self.job_retention_s < WEBHOOK_LONGEST_UNDELIVERED_S:
            raise ConfigError(
                f"JOB_RETENTION_S ({self.job_retention_s:g}) must be at least the webhook retry schedule "
                f"({WEBHOOK_LONGEST_UNDELIVERED_S:g} s, about 28 hours: every wait and each attempt's longest "
                f"lease): a finished job is kept until its webhooks are delivered or dead"
            )
        # A job's charge is read from its ledger rows, and the rollup recounts
        # the ledger's last days when a late change lands in them: a shorter
        # ledger retention would change what both say.
        ledger_floor_s = max(self.job_retention_s, ROLLUP_KEPT_S)
        if self.ledger_retention_s is not None and self.ledger_retention_s < ledger_floor_s:
            raise ConfigError(
                f"LEDGER_RETENTION_S ({self.ledger_retention_s:.10g}) must be at least JOB_RETENTION_S "
                f"({self.job_retention_s:.10g}) and the minute rollup's {ROLLUP_KEPT_S:.10g} s (8 days): a job's charge "
                f"and the rollup's recounts are read from the ledger; unset, the ledger is kept"
            )
