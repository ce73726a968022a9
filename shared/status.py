"""The job vocabulary: statuses, error codes and LLM call outcomes.

Each exists once in SQL too: JobStatus is the enum type ``job_status``,
Lane the enum type ``job_lane``;
ErrorCode and LlmOutcome are the domains ``error_code`` and ``llm_outcome``
(their constraints ``error_code_known`` and ``llm_outcome_known``).
tests/integration/test_schema.py fails when the two sides drift apart.
"""

from enum import StrEnum


class JobStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"


class Lane(StrEnum):
    """How a job reaches the provider: one call of its own (interactive), or
    a request in a message batch, within the day at half the price."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


class ErrorCode(StrEnum):
    """Why a job failed, as clients read it in ``error.code``."""

    # its worker stopped before the story was written: it died (the sweeper
    # saw its heartbeats stop) or shut down past its grace period
    INTERRUPTED = "interrupted"
    TIMED_OUT = "timed_out"  # it ran longer than JOB_TIMEOUT_S
    QUEUE_TIMEOUT = "queue_timeout"  # it waited longer than PENDING_TIMEOUT_S
    CANCELLED = "cancelled"  # the client (or an operator) cancelled it
    LLM_ERROR = "llm_error"  # the provider call failed in a way that may have billed
    LLM_REJECTED = "llm_rejected"  # the provider refused the request: a 4xx, or a 429 saying not to retry
    LLM_UNAVAILABLE = "llm_unavailable"  # retries of unbilled errors ran out
    INVALID_REQUEST = "invalid_request"  # the stored request no longer validates
    INTERNAL_ERROR = "internal_error"  # a bug in the worker; logged with the job id


class LlmOutcome(StrEnum):
    """How one request to the provider ended, as recorded in ``llm_calls``."""

    STARTED = "started"  # written before sending; stays so until someone knows more
    SUCCEEDED = "succeeded"
    STOPPED = "stopped"  # we closed the stream: the job was no longer ours
    RATE_LIMITED = "rate_limited"  # 429: not billed
    OVERLOADED = "overloaded"  # 529: not billed, retried
    CONNECT_FAILED = "connect_failed"  # nothing was sent: not billed, retried
    NOT_SENT = "not_sent"  # the job was lost before its request left: not billed
    REJECTED = "rejected"  # a 4xx other than 429: not retried
    FAILED = "failed"  # a timeout, a dropped stream, a 5xx: may have billed
    # nobody knows how it ended (its worker died, or its job was ended by
    # someone else while it was open): assumed billed
    INTERRUPTED = "interrupted"
    # a batch's request that expired (its batch ended first), was canceled
    # with its batch before it was processed, or ended in an error other than
    # a refusal of the request: not billed, sent again in a later batch
    EXPIRED = "expired"
    CANCELED = "canceled"
    ERRORED = "errored"

    @property
    def certainly_unbilled(self) -> bool:
        return self in (LlmOutcome.RATE_LIMITED, LlmOutcome.OVERLOADED, LlmOutcome.CONNECT_FAILED,
                        LlmOutcome.NOT_SENT, LlmOutcome.EXPIRED, LlmOutcome.CANCELED, LlmOutcome.ERRORED)
