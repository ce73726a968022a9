"""The job vocabulary: statuses, error codes and LLM call outcomes.

JobStatus mirrors the SQL enum ``job_status``; tests/integration/test_schema.py
fails when the two drift apart.
"""

from enum import StrEnum


class JobStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED)


class ErrorCode(StrEnum):
    """Why a job failed, as clients read it in ``error.code``."""

    INTERRUPTED = "interrupted"  # its worker stopped sending heartbeats (died)
    TIMED_OUT = "timed_out"  # it ran longer than JOB_TIMEOUT_S
    QUEUE_TIMEOUT = "queue_timeout"  # it waited longer than PENDING_TIMEOUT_S
    CANCELLED = "cancelled"  # the client cancelled it
    LLM_ERROR = "llm_error"  # the provider call failed in a way that may have billed
    LLM_REJECTED = "llm_rejected"  # the provider refused the request (4xx)
    LLM_UNAVAILABLE = "llm_unavailable"  # retries of unbilled errors ran out
    INVALID_REQUEST = "invalid_request"  # the stored request no longer validates
    INTERNAL_ERROR = "internal_error"  # a bug in the worker; logged with the job id


class LlmOutcome(StrEnum):
    """How one request to the provider ended, as recorded in ``llm_calls``."""

    STARTED = "started"  # written before sending; stays so if the worker died
    SUCCEEDED = "succeeded"
    STOPPED = "stopped"  # we closed the stream: the job was no longer ours
    RATE_LIMITED = "rate_limited"  # 429: not billed, retried
    OVERLOADED = "overloaded"  # 529: not billed, retried
    CONNECT_FAILED = "connect_failed"  # nothing was sent: not billed, retried
    REJECTED = "rejected"  # a 4xx other than 429: not retried
    FAILED = "failed"  # a timeout, a dropped stream, a 5xx: may have billed
    INTERRUPTED = "interrupted"  # its worker died mid-call: assumed billed

    @property
    def certainly_unbilled(self) -> bool:
        return self in (LlmOutcome.RATE_LIMITED, LlmOutcome.OVERLOADED, LlmOutcome.CONNECT_FAILED)
