"""The worker's Prometheus metrics (served on METRICS_PORT). Alerts that use
them are listed in README.md, Operations."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from shared.status import JobStatus, LlmOutcome
from worker.writing import CallRecord

JOB_TRANSITIONS = Counter(
    "storyjobs_job_transitions_total", "Job status changes made by this worker, by new status.", ["to"]
)
# children bound once: a worker touches these for every job
CLAIMED = JOB_TRANSITIONS.labels(to=JobStatus.RUNNING)
COMPLETED = JOB_TRANSITIONS.labels(to=JobStatus.COMPLETED)
FAILED = JOB_TRANSITIONS.labels(to=JobStatus.FAILED)

LOST_RACES = Counter(
    "storyjobs_lost_races_total",
    "Guarded updates that found the job no longer in the expected state, by transition.",
    ["transition"],
)
LOST_COMPLETION = LOST_RACES.labels(transition="running_to_completed")
LOST_FAILURE = LOST_RACES.labels(transition="running_to_failed")
LOST_OWNERSHIP = LOST_RACES.labels(transition="heartbeat")

_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300, 900, 1800)
JOB_QUEUE_WAIT = Histogram(
    "storyjobs_job_queue_wait_seconds", "From enqueue to claim, per claimed job.", buckets=_WAIT_BUCKETS
)
JOB_RUN = Histogram(
    "storyjobs_job_run_seconds",
    "From claim to the end of the job's work (story written or failure), per job.",
    buckets=(0.01, 0.1, 0.5, 1, 5, 15, 30, 60, 90, 120, 180, 240, 300, 480),
)

LLM_REQUESTS = Counter(
    "storyjobs_llm_requests_total", "Requests sent to the LLM provider, by how they ended.", ["outcome"]
)
LLM_REQUESTS_BY_OUTCOME: dict[LlmOutcome, Counter] = {
    outcome: LLM_REQUESTS.labels(outcome=outcome.value)
    for outcome in LlmOutcome
    if outcome not in (LlmOutcome.STARTED, LlmOutcome.INTERRUPTED)
}

LLM_TOKENS = Counter("storyjobs_llm_tokens_total", "Tokens billed by the provider.", ["direction"])
INPUT_TOKENS = LLM_TOKENS.labels(direction="input")
OUTPUT_TOKENS = LLM_TOKENS.labels(direction="output")

LLM_COST = Counter("storyjobs_llm_cost_usd_total", "LLM spend in US dollars, from the price table.")

WORKER_BUSY = Gauge("storyjobs_worker_busy", "Jobs this worker process holds right now.")
WORKER_SLOTS = Gauge("storyjobs_worker_slots", "Jobs this worker process may hold at once (WORKER_CONCURRENCY).")
WORKER_LAST_CLAIM = Gauge(
    "storyjobs_worker_last_claim_timestamp_seconds", "Unix time of this worker's last successful claim."
)

LLM_RATELIMIT_AVAILABLE = Gauge(
    "storyjobs_llm_ratelimit_available",
    "What the shared rate bucket held after this worker's last claim, by kind (requests, input_tokens, "
    "output_tokens); absent kinds have no configured limit.",
    ["kind"],
)
LLM_RATELIMIT_WAITS = Counter(
    "storyjobs_llm_ratelimit_waits_total",
    "Times the shared rate limiter held back a claim or a retry (jobs stayed pending, or a request waited).",
)
LLM_RATELIMITED = Counter(
    "storyjobs_llm_ratelimited_total", "429 answers received from the provider (each pauses every worker)."
)

DRAFT_WRITES_BY_OUTCOME = Counter(
    "storyjobs_draft_writes_total",
    "Statements that appended running jobs' text to their drafts, by outcome (written, failed: a database "
    "error; drafts are best effort, the jobs go on).",
    ["outcome"],
)
DRAFT_WRITES = DRAFT_WRITES_BY_OUTCOME.labels(outcome="written")
DRAFT_WRITES_FAILED = DRAFT_WRITES_BY_OUTCOME.labels(outcome="failed")


def count_call(record: CallRecord) -> None:
    """What one job's call cost and how it ended, counted once when the
    round takes its outcome."""
    LLM_REQUESTS_BY_OUTCOME[record.outcome].inc()
    if record.billed:
        INPUT_TOKENS.inc(record.input_tokens)
        OUTPUT_TOKENS.inc(record.output_tokens)
        LLM_COST.inc(float(record.cost_usd))
